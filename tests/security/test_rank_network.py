"""The network as a weapon, against a real sandboxed node agent (TRAINYARD_NODE_SANDBOX=enforce), the real
broker and the real redis-server:

- a rank connects to the broker's port, Redis's port and the API's port (an HTTP server the test runs in its
  place), listed in ``TRAINYARD_NODE_RANK_BLOCKED``: every connection is refused (the agent's nftables rules
  on the job uid range), also through the node's IPv6 loopback, while a port not listed stays reachable, the
  agent (root) keeps heartbeating through the broker and Redis, and a victim job of another tenant on the same
  node ends ``ok``; after the agent closes, its rules are gone;
- an agent under enforce that cannot install its rules refuses to start, naming nftables and the setting;
- a squatted rendezvous port: another process listens on the GangAllocated's master port, and the agent starts
  no rank, reporting a retryable ``error`` that names the port; the next attempt, on another port, runs;
- a squatted Lighthouse port (``faultTolerance``): the same — the ranks would dial the squatter for their quorums.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from trainyard_cli import infra
from trainyard_contract.events import (
    GangAllocated,
    NodeAssignment,
    NodeHeartbeat,
    RankAssignment,
    WorkerExited,
    WorkerStarted,
)
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout
from trainyard_node_agent.rank_network import SETTING, table_name
from trainyard_node_agent.settings import NodeAgentSettings

from tests.conftest import env_vars
from tests.integration.test_node_agent import reap_ranks  # noqa: F401 - autouse: no rank outlives a test
from tests.integration.test_node_agent_failures import NODE, Rig, heartbeat_after, rig  # noqa: F401 - fixture
from tests.integration.test_scheduler_stack import poll
from tests.security.test_rank_sandbox import VICTIM, VICTIM_TENANT, code_spec, start_agent, store_archive

pytestmark = [pytest.mark.integration, pytest.mark.security, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (scripts/ensure-system-deps.sh)")]

ATTACKER_TENANT = "t1"
# Connects to every target (name → [host, port]); what each connect did goes to its checkpoint prefix; exits 0
# when every blocked one was refused and the open one connected, 1 otherwise.
ATTACKER = r"""
import json, os, pathlib, socket, sys
env = os.environ
own = pathlib.Path(env["TRAINYARD_ARTIFACT_ROOT"], "tenants", env["TRAINYARD_TENANT"], "jobs",
                   env["TRAINYARD_JOB_ID"], "checkpoints")
seen = {}
for name, (host, port) in json.loads(env["TARGETS"]).items():
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect((host, port))
            seen[name] = "connected"
    except OSError as exc:
        seen[name] = f"{type(exc).__name__}: {exc}"
own.mkdir(parents=True, exist_ok=True)
(own / "network.json").write_text(json.dumps(seen))
print(json.dumps(seen), flush=True)
blocked_ok = all(v != "connected" for k, v in seen.items() if k != "open")
sys.exit(0 if blocked_ok and seen.get("open") == "connected" else 1)
"""


class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"api")

    def log_message(self, *_args: Any) -> None:
        pass


@contextlib.contextmanager
def http_server(host: str = "127.0.0.1") -> Iterator[int]:
    """An HTTP server on a free port of ``host`` (in this process: root), its port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_cls = type("Server", (http.server.ThreadingHTTPServer,), {"address_family": family})
    server = server_cls((host, infra.free_port()), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def agent_table(rig: Rig) -> str:
    """The name of the agent's table (node id and state directory, as the agent derives it)."""
    settings = NodeAgentSettings(**{**rig.env, **rig.agent_settings})  # type: ignore[arg-type]  # settings from strings, as the environment gives them
    return table_name(NODE, str(settings.agent_state_path.parent.resolve()))


def table_listed(table: str) -> str | None:
    done = subprocess.run(["nft", "list", "table", "inet", table], capture_output=True, text=True, check=False)
    return done.stdout if done.returncode == 0 else None


@pytest.fixture
def table(rig: Rig) -> Iterator[str]:
    """The agent's table; whatever happens to the agent (SIGKILL at the end of a test), gone afterwards."""
    name = agent_table(rig)
    yield name
    subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, check=False)


async def publish_gang(rig: Rig, job_id: str, tenant: str, device: int, spec: TrainingSpec, *, attempt: int = 1,
                       master_port: int | None = None, lighthouse_port: int | None = None) -> GangAllocated:
    """Lease one device and publish a one-rank GangAllocated (playing the scheduler)."""
    allocation_id = f"{job_id}-a{attempt}"
    epoch = await LeaseManager(rig.redis).acquire(job_id, allocation_id, [Device(NODE, device)])
    event = GangAllocated(
        job_id=job_id, tenant=tenant, attempt=attempt, allocation_id=allocation_id, epoch=epoch, world_size=1,
        nodes=[NodeAssignment(node_id=NODE, host="127.0.0.1",
                              ranks=[RankAssignment(rank=0, local_rank=0, device_index=device)])],
        master_addr="127.0.0.1", master_port=master_port or infra.free_port(), spec=spec,
        spec_hash=spec.spec_hash(), lighthouse_port=lighthouse_port,
    )
    await rig.publisher.publish(event)
    return event


def control_plane(rig: Rig) -> dict[str, int]:
    """The ports of the broker and Redis the agent uses."""
    redis_port = urlsplit(rig.env["redis_url"]).port
    assert redis_port is not None
    return {"broker": int(rig.env["kafka_bootstrap"].rpartition(":")[2]), "redis": redis_port}


async def release(layout: ArtifactLayout, job_id: str) -> None:
    """Let a VICTIM rank end, once it has written its shard."""
    out = layout.checkpoints_dir(VICTIM_TENANT, job_id)

    async def ready() -> bool:
        return (out / "ready").exists()

    await poll(ready, f"{job_id} to write its shard")
    (out / "release").write_text("")


def reachable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.settimeout(5)
        return sock.connect_ex((host, port)) == 0


async def test_a_rank_cannot_reach_the_broker_redis_or_the_api_and_the_rules_go_with_the_agent(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str) -> None:
    layout = ArtifactLayout(rig.env["artifact_root"])
    dataset = layout.dataset_dir("tinycorpus", "v1")  # make_spec's
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_text('{"the": "manifest"}')  # the victim reads it
    ports = control_plane(rig)
    with http_server() as api_port, http_server() as open_port, http_server("::1") as api6_port:
        blocked = f"127.0.0.1:{ports['broker']},localhost:{ports['redis']},127.0.0.1:{api_port},[::1]:{api6_port}"
        agent = start_agent(rig, tmp_path, monkeypatch, node_rank_blocked=blocked)
        await heartbeat_after(rig.tap)
        listed = table_listed(table)
        assert listed is not None and f"dport {ports['redis']}" in listed, rig.services.log("agent")[-4000:]

        victim_code = store_archive(layout, VICTIM_TENANT, tmp_path / "victim", {"main.py": VICTIM})
        await publish_gang(rig, "victim", VICTIM_TENANT, 0, code_spec(victim_code, {"SECRET": "s"}))
        await rig.tap.wait(WorkerStarted, job_id="victim", timeout_s=60)

        targets = {"broker": ["127.0.0.1", ports["broker"]], "redis": ["127.0.0.1", ports["redis"]],
                   "redis-via-localhost-v6": ["::1", ports["redis"]], "api": ["127.0.0.1", api_port],
                   "api-v6": ["::1", api6_port], "open": ["127.0.0.1", open_port]}
        code = store_archive(layout, ATTACKER_TENANT, tmp_path / "attacker", {"main.py": ATTACKER})
        await publish_gang(rig, "net-attack", ATTACKER_TENANT, 1, code_spec(code, {"TARGETS": json.dumps(targets)}))
        (exited,) = await rig.tap.wait(WorkerExited, job_id="net-attack", timeout_s=120)
        out = layout.checkpoints_dir(ATTACKER_TENANT, "net-attack") / "network.json"
        seen = json.loads(out.read_text()) if out.exists() else {"missing": rig.services.log("agent")[-4000:]}
        print(json.dumps(seen, indent=1))  # what each connect ran into (shown with -s)
        for name in ("broker", "redis", "api", "api-v6"):
            assert "Connection refused" in seen.get(name, ""), seen
        assert seen.get("redis-via-localhost-v6") != "connected", seen  # nothing listens there, or refused
        assert seen.get("open") == "connected", seen  # only what is listed is refused
        assert (exited.exit_code, exited.reason) == (0, "ok"), exited

        # the agent (root) still reaches both, and so does everyone but the job uids
        beats = len(rig.tap.events(NodeHeartbeat, node_id=NODE))
        await rig.tap.wait(NodeHeartbeat, beats + 2, node_id=NODE, timeout_s=60)
        assert all(reachable(p) for p in (ports["broker"], ports["redis"], api_port))
        assert agent.poll() is None

        # the victim, of another tenant, on the same node, ends ok once released
        await release(layout, "victim")
        (done,) = await rig.tap.wait(WorkerExited, job_id="victim", timeout_s=60)
        assert (done.exit_code, done.reason) == (0, "ok"), done
        await LeaseManager(rig.redis).release("victim-a1", done.epoch, [Device(NODE, 0)])

        agent.send_signal(signal.SIGTERM)
        assert rig.services.wait(agent, "agent", timeout_s=60) == 0
        assert table_listed(table) is None, "the agent's rules are deleted when it closes"
        assert "deleted the nftables table" in rig.services.log("agent")


def test_an_agent_that_cannot_install_its_rules_refuses_to_start(rig: Rig, tmp_path: Path, table: str) -> None:
    settings = {**rig.agent_settings, "node_sandbox": "enforce", "code_cache_dir": tmp_path / "code-cache",
                "node_rank_blocked": "127.0.0.1:6390"}
    own = {f"TRAINYARD_{k.upper()}": str(v) for k, v in settings.items()}
    bare = str(Path(sys.executable).parent)  # no nft on this PATH
    environ = {**os.environ, **env_vars(rig.env), **own, "PATH": bare}
    done = subprocess.run([sys.executable, "-m", "trainyard_node_agent"], env=environ, capture_output=True,  # noqa: S603 - our own module
                          text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "cannot be installed with nftables" in done.stderr and SETTING in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert table_listed(table) is None


async def test_a_squatted_rendezvous_port_starts_no_rank_and_interrupts_the_attempt(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = ArtifactLayout(rig.env["artifact_root"])
    dataset = layout.dataset_dir("tinycorpus", "v1")
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_text('{"the": "manifest"}')
    start_agent(rig, tmp_path, monkeypatch)
    await heartbeat_after(rig.tap)
    code = store_archive(layout, VICTIM_TENANT, tmp_path / "victim", {"main.py": VICTIM})
    spec = code_spec(code, {"SECRET": "s"})
    port = infra.free_port()
    squatter = subprocess.Popen(  # noqa: S603 - another process listening on the port, as a survivor would
        [sys.executable, "-c", "import socket, sys, time\n"
         f"s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); print('ready', flush=True)\n"
         "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "ready"
        first = await publish_gang(rig, "squatted", VICTIM_TENANT, 0, spec, master_port=port)
        (exited,) = await rig.tap.wait(WorkerExited, job_id="squatted", timeout_s=60)
    finally:
        squatter.kill()
        squatter.wait(10)
    # an interruption for the scheduler: another port, no failure budget spent, no node blamed (test_blame.py)
    assert exited.reason == "port-in-use" and exited.exit_code != 0, exited
    assert f"rendezvous port {port} is already in use on {NODE}" in (exited.detail or ""), exited
    assert rig.tap.events(WorkerStarted, job_id="squatted") == [], "no rank started"
    assert not layout.rank_log(VICTIM_TENANT, "squatted", 1, 0).exists() or \
        "victim alive" not in layout.rank_log(VICTIM_TENANT, "squatted", 1, 0).read_text()
    await LeaseManager(rig.redis).release(first.allocation_id, first.epoch, [Device(NODE, 0)])

    # the scheduler's next attempt draws another port: it runs
    await publish_gang(rig, "squatted", VICTIM_TENANT, 0, spec, attempt=2)
    await rig.tap.wait(WorkerStarted, job_id="squatted", timeout_s=60)
    await release(layout, "squatted")
    exits = await rig.tap.wait(WorkerExited, 2, job_id="squatted", timeout_s=60)
    assert [(e.attempt, e.reason) for e in exits][-1] == (2, "ok"), exits


async def test_a_squatted_lighthouse_port_starts_no_rank_and_interrupts_the_attempt(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault-tolerant job's ranks dial the Lighthouse at master_addr:lighthouse_port for every step's quorum: a
    process already listening there would hand them its quorums. The agent of rank 0 checks the port first."""
    layout = ArtifactLayout(rig.env["artifact_root"])
    dataset = layout.dataset_dir("tinycorpus", "v1")
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_text('{"the": "manifest"}')
    start_agent(rig, tmp_path, monkeypatch)
    await heartbeat_after(rig.tap)
    code = store_archive(layout, VICTIM_TENANT, tmp_path / "victim", {"main.py": VICTIM})
    plain = code_spec(code, {"SECRET": "s"})
    wire = plain.wire()
    wire["resources"]["gpuCount"] = wire["parallelism"]["data"] = 2
    wire["training"]["globalBatchSize"] = 2 * wire["training"]["microBatchSize"]
    spec = TrainingSpec.model_validate({**wire, "faultTolerance": {"replicas": 2, "minReplicas": 1}})
    port = infra.free_port()
    squatter = subprocess.Popen(  # noqa: S603 - another process listening on the port, as a survivor would
        [sys.executable, "-c", "import socket, sys, time\n"
         f"s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(); print('ready', flush=True)\n"
         "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "ready"
        first = await publish_gang(rig, "lh-squatted", VICTIM_TENANT, 0, spec, lighthouse_port=port)
        (exited,) = await rig.tap.wait(WorkerExited, job_id="lh-squatted", timeout_s=60)
    finally:
        squatter.kill()
        squatter.wait(10)
    assert exited.reason == "port-in-use" and exited.exit_code != 0, exited
    assert f"lighthouse port {port} is already in use on {NODE}" in (exited.detail or ""), exited
    assert rig.tap.events(WorkerStarted, job_id="lh-squatted") == [], "no rank started"
    await LeaseManager(rig.redis).release(first.allocation_id, first.epoch, [Device(NODE, 0)])
