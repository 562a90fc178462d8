"""TRAINYARD_NODE_SANDBOX at agent start-up, with real agent processes: ``enforce`` where ranks cannot
be confined (here: an agent in an unprivileged user namespace, root there but nowhere else) refuses to
start and says what to do; ``trusted-single-tenant`` starts, says loudly that ranks are unsandboxed,
and heartbeats its mode (what ``GET /v1/admin/nodes`` shows)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from trainyard_contract.events import NodeHeartbeat

from tests.conftest import env_vars
from tests.integration.test_node_agent import reap_ranks  # noqa: F401 - autouse: no rank outlives a test
from tests.integration.test_node_agent_failures import NODE, Rig, rig  # noqa: F401 - fixture

pytestmark = [pytest.mark.integration, pytest.mark.security]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_enforce_where_ranks_cannot_be_confined_refuses_to_start_and_says_what_to_do(
        rig: Rig, tmp_path: Path) -> None:
    own = {f"TRAINYARD_{k.upper()}": str(v) for k, v in {**rig.agent_settings, "node_sandbox": "enforce"}.items()}
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", sys.executable, "-m", "trainyard_node_agent"],
        env={**os.environ, **env_vars(rig.env), **own}, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    err = done.stderr
    assert "TRAINYARD_NODE_SANDBOX=enforce, but ranks cannot be sandboxed on this host" in err, err[-3000:]
    assert "TRAINYARD_NODE_SANDBOX=trusted-single-tenant" in err and "Traceback" not in err, err[-3000:]


async def test_a_trusted_single_tenant_node_says_so_loudly_and_in_its_heartbeat(rig: Rig) -> None:
    rig.services.start("trainyard_node_agent", "agent", **rig.agent_settings, node_sandbox="trusted-single-tenant")
    (beat,) = await rig.tap.wait(NodeHeartbeat, node_id=NODE, timeout_s=90)
    assert beat.sandbox == "trusted-single-tenant"
    assert "ranks run UNSANDBOXED" in rig.services.log("agent")
