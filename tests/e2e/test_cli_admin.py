"""`trainyard admin …` as an operator types it, against the real API process (over the suite's broker and
Redis), from a directory whose `.trainyard/` holds what the local stack writes (api-url, and the admin-token
the API bootstraps): no --api-url, no --token. Tenants and tokens are created, listed and revoked through
the API; a revoked token is refused; when the API is unreachable every command says so in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainyard_cli import infra
from tests.support.api import api_in_thread


def trainyard(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINYARD_TOKEN", "TRAINYARD_API_URL")}
    return subprocess.run([sys.executable, "-m", "trainyard_cli", *args], cwd=cwd, env={**env, "COLUMNS": "200"},
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_tenants_and_tokens_through_the_api_and_a_clear_message_when_it_is_unreachable(env: dict,
                                                                                      tmp_path: Path) -> None:
    state = tmp_path / ".trainyard"
    state.mkdir()
    work = tmp_path / "project" / "sub"
    work.mkdir(parents=True)
    with api_in_thread(env, api_bootstrap_admin_token_file=state / "admin-token") as url:
        (state / "api-url").write_text(url + "\n")

        made = trainyard(work, "admin", "tenants", "create", "research", "--quota", "cpu=8:4")
        assert made.returncode == 0, made.stderr
        assert "research" in made.stdout and "cpu: 8+4" in made.stdout

        issued = trainyard(work, "admin", "tokens", "create", "--tenant", "research", "--name", "ci", "--ttl", "1h")
        assert issued.returncode == 0, issued.stderr
        secret = issued.stdout.strip()
        assert secret.startswith("ty_") and "tok_" in issued.stderr and "submitter" in issued.stderr

        listed = trainyard(work, "admin", "tokens", "list", "--tenant", "research", "--json")
        assert listed.returncode == 0, listed.stderr
        assert secret not in listed.stdout
        (ci,) = json.loads(listed.stdout)["tokens"]
        assert (ci["name"], ci["role"], ci["state"]) == ("ci", "submitter", "active") and ci["expiresAt"]

        assert trainyard(work, "--token", secret, "jobs", "list").returncode == 0
        revoked = trainyard(work, "admin", "tokens", "revoke", ci["tokenId"], "--tenant", "research")
        assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
        refused = trainyard(work, "--token", secret, "jobs", "list")
        assert refused.returncode == 1 and "revoked" in refused.stderr and "Traceback" not in refused.stderr

        alias = trainyard(work, "admin", "create-token", "--tenant", "research", "--name", "old-habit")
        assert alias.returncode == 0 and alias.stdout.strip().startswith("ty_"), alias.stderr
        viewer = trainyard(work, "admin", "tokens", "create", "--tenant", "research", "--role", "viewer")
        as_viewer = trainyard(work, "--token", viewer.stdout.strip(), "admin", "tokens", "list", "--tenant", "research")
        assert as_viewer.returncode == 1 and "needs tenant-admin" in as_viewer.stderr

        quota = trainyard(work, "admin", "tenants", "set-quota", "research", "--device", "cpu", "--guaranteed", "2",
                          "--max-priority", "100")
        assert quota.returncode == 0, quota.stderr
        shown = json.loads(trainyard(work, "admin", "tenants", "get", "research", "--json").stdout)
        assert shown["settings"]["quotas"]["cpu"] == {"guaranteed": 2, "borrowLimit": None}
        assert shown["settings"]["maxPriority"] == 100

        bad = trainyard(work, "admin", "tokens", "create", "--tenant", "research", "--role", "root")
        assert bad.returncode == 1 and "role" in bad.stderr and "Traceback" not in bad.stderr

        audit = json.loads(trainyard(work, "admin", "audit", "--tenant", "research", "--json").stdout)
        actions = [(e["action"], e["outcome"]) for e in audit["entries"]]
        assert ("token.revoke", "ok") in actions and ("tenant.update", "ok") in actions
        assert ("token.create", "invalid") in actions  # the refused --role root, recorded too

    nobody = f"http://127.0.0.1:{infra.free_port()}"
    (state / "api-url").write_text(nobody + "\n")
    (state / "dev-token").write_text(secret + "\n")
    for args in (("admin", "tokens", "list", "--tenant", "research"), ("admin", "tenants", "list"),
                 ("admin", "create-token", "--tenant", "research"), ("jobs", "list")):
        down = trainyard(work, *args)
        assert down.returncode == 1, (args, down.stdout, down.stderr)
        assert f"cannot reach the trainyard API at {nobody}" in down.stderr and "make up" in down.stderr, down.stderr
        assert "Traceback" not in down.stderr and len(down.stderr.strip().splitlines()) <= 3, down.stderr
