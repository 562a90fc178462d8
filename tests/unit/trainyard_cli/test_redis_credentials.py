"""Redis ACL users: the ACL file (no anonymous clients, service users on the keys the keyspace declaration
gives them, without @dangerous), stable passwords, URLs per service, and `trainyard admin credentials redis`."""

from __future__ import annotations

import stat
from pathlib import Path

import yaml
from typer.testing import CliRunner

from trainyard_cli import redisacl
from trainyard_runtime import keyspace
from trainyard_cli.main import app


def test_the_acl_file_gives_every_user_a_password_and_fences_the_services() -> None:
    text = redisacl.acl_text({"scheduler": "p1", "operator": "p2", "default": "p3"})
    lines = text.splitlines()
    assert "user default on >p3 ~* &* +@all" in lines  # no nopass: anonymous clients get NOAUTH
    assert f"user scheduler on >p1 {keyspace.acl_rules('scheduler')}" in lines  # generated from the keyspace
    assert "~ty:*" not in text and "&*" not in text.replace("~* &* +@all", "")
    assert "user operator on >p2 ~* &* +@all" in lines
    assert all("nopass" not in line for line in lines)


def test_every_service_of_the_keyspace_is_a_user_and_an_unknown_name_gets_nothing() -> None:
    assert set(redisacl.SERVICE_USERS) == set(keyspace.SERVICES) and "telemetry" in redisacl.SERVICE_USERS
    assert redisacl.rules_for("retired-service") == "resetkeys resetchannels -@all"


def test_passwords_are_made_once_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    first = redisacl.load_or_create(path)
    assert set(first) == {*redisacl.SERVICE_USERS, redisacl.OPERATOR, redisacl.DEFAULT}
    assert redisacl.load_or_create(path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_urls_quote_the_password() -> None:
    assert redisacl.url_for("node-agent", "a/b:c", host="h", port=1) == "redis://node-agent:a%2Fb%3Ac@h:1/0"


def test_the_cli_writes_the_acl_file_and_a_secret_per_service(tmp_path: Path) -> None:
    out = tmp_path / "creds"
    done = CliRunner().invoke(app, ["admin", "credentials", "redis", "--out", str(out), "--host", "redis.x"])
    assert done.exit_code == 0, done.output
    passwords = redisacl.load_or_create(out / "passwords.json")
    secret = yaml.safe_load((out / "trainyard-redis-users.yaml").read_text())
    assert secret["kind"] == "Secret" and set(secret["stringData"]) == set(redisacl.SERVICE_USERS)
    assert secret["stringData"]["scheduler"] == redisacl.url_for("scheduler", passwords["scheduler"], host="redis.x",
                                                                 port=6379)
    assert (out / "users.acl").read_text() == redisacl.acl_text(passwords)
    assert (out / "registry.env").read_text().strip() == "TRAINYARD_REDIS_URL=" + secret["stringData"]["registry"]
