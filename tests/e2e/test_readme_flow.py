"""The README's commands, in the order it shows them, as a new user types them: `trainyard dev up`
(what `make up` runs) on a fresh state directory, then `trainyard submit examples/tiny.yaml`, which
must be accepted without any other step (the example dataset is published by `up`), then the job
commands, then the tenant-administration commands, then `trainyard dev down`. A second `up` is idempotent and does not
build the data again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.support.cli import LocalCli

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_submit_works_right_after_up(tmp_path: Path) -> None:
    trainyard = LocalCli(tmp_path, nodes=1)

    try:
        up = trainyard("dev", "up", timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "tinycorpus@v1" in up.stderr and "next:" in up.stderr, up.stderr

        submitted = trainyard("submit", str(REPO / "examples/tiny.yaml"))
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        match = re.search(r"submitted (job-[0-9a-f]+)", submitted.stdout)
        assert match, submitted.stdout
        job_id = match.group(1)

        listed = trainyard("jobs", "list")
        assert listed.returncode == 0 and job_id in listed.stdout, listed.stdout + listed.stderr
        got = trainyard("jobs", "get", job_id)
        assert got.returncode == 0 and job_id in got.stdout, got.stdout + got.stderr
        # cancel: of a job still training (the tiny one may have finished already on a fast machine)
        spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
        spec["training"]["maxSteps"] = 100_000
        (tmp_path / "long.yaml").write_text(yaml.safe_dump(spec))
        long_run = trainyard("submit", str(tmp_path / "long.yaml"))
        assert long_run.returncode == 0, long_run.stdout + long_run.stderr
        long_id = re.search(r"submitted (job-[0-9a-f]+)", long_run.stdout).group(1)  # type: ignore[union-attr]  # present here (the test asserts it)
        cancelled = trainyard("jobs", "cancel", long_id)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr

        # tenant administration, as the README shows it: through the API, with the bootstrapped admin token
        made = trainyard("admin", "tenants", "create", "research", "--quota", "cpu=8:4", "--max-priority", "100")
        assert made.returncode == 0 and "research" in made.stdout, made.stdout + made.stderr
        issued = trainyard("admin", "tokens", "create", "--tenant", "research", "--name", "ci", "--ttl", "30d")
        assert issued.returncode == 0 and issued.stdout.startswith("ty_"), issued.stdout + issued.stderr
        token_id = re.search(r"tok_[0-9a-f]{12}", issued.stderr).group(0)  # type: ignore[union-attr]  # present here (the test asserts it)
        listed = trainyard("admin", "tokens", "list", "--tenant", "research")
        assert listed.returncode == 0 and token_id in listed.stdout and issued.stdout.strip() not in listed.stdout
        assert trainyard("admin", "tokens", "revoke", token_id, "--tenant", "research").returncode == 0
        quota = trainyard("admin", "tenants", "set-quota", "research", "--device", "cpu", "--guaranteed", "16")
        assert quota.returncode == 0, quota.stdout + quota.stderr
        audit = trainyard("admin", "audit", "--tenant", "research")
        assert audit.returncode == 0 and "token.revoke" in audit.stdout, audit.stdout + audit.stderr

        again = trainyard("dev", "up", timeout=600)  # idempotent: everything already runs, the data exists
        assert again.returncode == 0, again.stdout + again.stderr
        assert "preparing dataset" not in again.stderr, again.stderr
    finally:
        down = trainyard("dev", "down", timeout=120)
    assert down.returncode == 0 and "broker" in down.stderr and "redis" in down.stderr, down.stdout + down.stderr
