"""`trainyard admin credentials …`: control-plane credentials for a deployment (files only; talks to nothing).

``redis``: a password per service user, the ACL file for redis-server (``--aclfile``; no anonymous clients),
a Kubernetes Secret ``trainyard-redis-users`` holding each service's TRAINYARD_REDIS_URL (the
manifests in deploy/k8s read it) and ``<service>.env`` files with the same (docker compose ``env_file``). Run it again
to add missing users; existing passwords are kept.
"""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from trainyard_cli import redisacl
from trainyard_cli.console import stderr

credentials_app = typer.Typer(help="Control-plane credentials for a deployment (Redis ACL users; files only).",
                              no_args_is_help=True)


def secret_manifest(passwords: dict[str, str], *, host: str, port: int, namespace: str) -> str:
    """The Secret with one TRAINYARD_REDIS_URL per service (key: the service name). Pure."""
    urls = {user: redisacl.url_for(user, passwords[user], host=host, port=port) for user in redisacl.SERVICE_USERS}
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": "trainyard-redis-users", "namespace": namespace},
        "stringData": urls,
    }, sort_keys=False)


@credentials_app.command("redis")
def redis_users(
    out: Path = typer.Option(Path("redis-credentials"), "--out", help="directory for the three files (mode 0600)"),
    host: str = typer.Option("redis.trainyard", "--host", help="the Redis host the services connect to"),
    port: int = typer.Option(6379, "--port", help="its port"),
    namespace: str = typer.Option("trainyard", "--namespace", help="namespace of the Kubernetes Secret"),
) -> None:
    """Write passwords.json, users.acl (for redis-server --aclfile), trainyard-redis-users.yaml (a Secret)
    and <service>.env (docker compose)."""
    passwords = redisacl.load_or_create(out / "passwords.json")
    acl = redisacl.write_acl_file(out / "users.acl", passwords)
    secret = out / "trainyard-redis-users.yaml"
    secret.write_text(secret_manifest(passwords, host=host, port=port, namespace=namespace))
    secret.chmod(0o600)
    for user in redisacl.SERVICE_USERS:
        env_file = out / f"{user}.env"
        env_file.write_text(f"TRAINYARD_REDIS_URL={redisacl.url_for(user, passwords[user], host=host, port=port)}\n")
        env_file.chmod(0o600)
    stderr().print(f"wrote {acl} (redis-server --aclfile {acl.name}; anonymous clients are refused), {secret} "
                  f"(kubectl apply -f {secret}) and {out / 'passwords.json'}; keep them secret")
