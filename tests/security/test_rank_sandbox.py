"""Malicious training scripts against a real node agent (TRAINYARD_NODE_SANDBOX=enforce), the real broker
and Redis, as real processes: each attack must fail and its rank be reported as failed, while a victim
job of another tenant, running on the same node the whole time, is unaffected and ends ``ok``.

The attacks: read another tenant's checkpoint; overwrite another job's shard; kill, ptrace or read the
memory of another job's rank (its pid handed to the attacker, which could not even list it); kill the
node agent; read the agent's state, another job's code tree, the whole artifact root; write to its own
dataset or code tree; become root again; find Redis or broker addresses or credentials in its
environment; escape its code tree through symlinks or ``..`` in the uploaded archive. And a fine-tune
(``initFrom``) reads the start checkpoint of another job, read-only, and sees nothing else of that job."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from trainyard_cli import infra
from trainyard_contract.codetree import archive_id, pack
from trainyard_contract.events import (
    CheckpointRef,
    GangAllocated,
    NodeAssignment,
    NodeHeartbeat,
    RankAssignment,
    WorkerExited,
    WorkerStarted,
)
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.spec import InitFrom, TrainingSpec
from trainyard_contract.storage import ArtifactLayout, path_to_uri

from tests.integration.test_node_agent import reap_ranks  # noqa: F401 - autouse: no rank outlives a test
from tests.integration.test_node_agent_failures import NODE, Rig, heartbeat_after, rig  # noqa: F401 - fixture
from tests.integration.test_scheduler_stack import make_spec, poll

pytestmark = [pytest.mark.integration, pytest.mark.security, pytest.mark.slow]

VICTIM_TENANT, ATTACKER_TENANT = "victim-co", "t1"
SECRET = "the victim's weights"
# Holds a checkpoint shard, then runs until the test drops ``release`` into its checkpoint prefix.
VICTIM = r"""
import os, pathlib, time
out = pathlib.Path(os.environ["TRAINYARD_ARTIFACT_ROOT"], "tenants", os.environ["TRAINYARD_TENANT"], "jobs",
                   os.environ["TRAINYARD_JOB_ID"], "checkpoints")
shard = out / "step-000000001-a1" / "shard-rank0.pt"
shard.parent.mkdir(parents=True, exist_ok=True)
shard.write_text(os.environ["SECRET"])
dataset = pathlib.Path(os.environ["TRAINYARD_ARTIFACT_ROOT"], "datasets", "tinycorpus", "v1", "manifest.json")
(out / "ready").write_text(dataset.read_text())  # its own dataset it reads
while not (out / "release").exists():
    print("victim alive", flush=True)
    time.sleep(0.2)
print("victim done", shard.read_text() == os.environ["SECRET"], flush=True)
"""
# One attack per job (ATTACK): what it tried and what came of it goes to its own checkpoint prefix, then
# it exits 0 only if the attack worked (a breach) and 1 if it was refused.
ATTACKER = r"""
import ctypes, json, os, pathlib, signal, sys
env = os.environ
root = pathlib.Path(env["TRAINYARD_ARTIFACT_ROOT"])
own = root / "tenants" / env["TRAINYARD_TENANT"] / "jobs" / env["TRAINYARD_JOB_ID"] / "checkpoints"
victim_ckpt = root / "tenants" / env["VICTIM_TENANT"] / "jobs" / "victim" / "checkpoints"
shard = victim_ckpt / "step-000000001-a1" / "shard-rank0.pt"
victim_pid, agent_pid = int(env["VICTIM_PID"]), int(env["AGENT_PID"])
libc = ctypes.CDLL(None, use_errno=True)

def read_shard(): return shard.read_text()
def overwrite_shard(): shard.write_text("pwned"); return "overwritten"
def plant_shard():
    shard.parent.mkdir(parents=True, exist_ok=True); (shard.parent / "evil.pt").write_text("x"); return "planted"
def kill_victim(): os.kill(victim_pid, signal.SIGKILL); return "killed"
def kill_agent(): os.kill(agent_pid, signal.SIGKILL); return "killed the agent"
def ptrace_victim():
    if libc.ptrace(16, victim_pid, None, None) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return "attached"
def victim_memory():
    with open(f"/proc/{victim_pid}/mem", "rb") as fh: return fh.read(1)
def list_processes():
    seen = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) in (victim_pid, agent_pid))
    if seen: return f"sees {seen}"
    raise PermissionError("neither the victim nor the agent is visible in /proc")
def agent_state(): return (root / "nodes" / env["NODE"] / "agent-ranks.json").read_text()[:50]
def other_code(): return os.listdir(env["VICTIM_TREE"])
def list_tenants():
    names = os.listdir(root / "tenants")
    if names != [env["TRAINYARD_TENANT"]]: return f"sees {names}"
    raise PermissionError(f"only its own tenant: {names}")
def write_dataset():
    (root / "datasets" / "tinycorpus" / "v1" / "evil").write_text("x"); return "wrote"
def write_code(): (pathlib.Path(env["TRAINYARD_CODE_DIR"]) / "evil.py").write_text("x"); return "wrote"
def become_root(): os.setuid(0); return "root"
def stack_state(): return pathlib.Path(env["STACK_AOF"]).read_text()  # a local stack's Redis AOF, world-readable
def credentials():
    found = {k: v for k, v in env.items() if k != "BROKER_PORT" and (
             any(s in k.upper() for s in ("REDIS", "KAFKA", "BOOTSTRAP", "SECRET", "TOKEN", "PASSWORD", "OTEL_EXPORTER_OTLP_HEADERS"))
             or any(s in v for s in ("redis://", "s3cr3t", ":6390", ":" + env["BROKER_PORT"])))}
    if found: return f"found {sorted(found)}"
    raise PermissionError("no credentials or control-plane addresses in the environment")

attack = env["ATTACK"]
own.mkdir(parents=True, exist_ok=True)
try:
    outcome = {"attack": attack, "breach": repr(globals()[attack]())}
except (OSError, ValueError) as exc:
    outcome = {"attack": attack, "refused": f"{type(exc).__name__}: {exc}"}
(own / "outcome.json").write_text(json.dumps(outcome))
print(json.dumps(outcome), flush=True)
sys.exit(0 if "breach" in outcome else 1)
"""  # noqa: E501 - a rank's script, run as written
ATTACKS = ("read_shard", "overwrite_shard", "plant_shard", "kill_victim", "kill_agent", "ptrace_victim",
           "victim_memory", "list_processes", "agent_state", "other_code", "list_tenants", "write_dataset",
           "write_code", "become_root", "credentials", "stack_state")


def store_archive(layout: ArtifactLayout, tenant: str, src: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return store_bytes(layout, tenant, pack(src, list(files)))


def store_bytes(layout: ArtifactLayout, tenant: str, data: bytes) -> str:
    """Store an archive where the API stores uploads; its ``sha256:<hex>`` id."""
    ident = archive_id(data)
    path = layout.code_archive(tenant, ident.removeprefix("sha256:"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return ident


def code_spec(archive: str, env: dict[str, str]) -> TrainingSpec:
    wire = make_spec(1).model_dump(by_alias=True, mode="json")
    return TrainingSpec.model_validate({**wire, "code": {"archive": archive, "entrypoint": [sys.executable, "main.py"],
                                                         "env": env}})


async def gang(rig: Rig, job_id: str, tenant: str, device: int, spec: TrainingSpec,
               start: CheckpointRef | None = None) -> GangAllocated:
    """Lease one device and publish a one-rank GangAllocated (playing the scheduler)."""
    allocation_id = f"{job_id}-a1"
    epoch = await LeaseManager(rig.redis).acquire(job_id, allocation_id, [Device(NODE, device)])
    event = GangAllocated(
        job_id=job_id, tenant=tenant, attempt=1, allocation_id=allocation_id, epoch=epoch, world_size=1,
        nodes=[NodeAssignment(node_id=NODE, host="127.0.0.1", ranks=[RankAssignment(rank=0, local_rank=0,
                                                                                    device_index=device)])],
        master_addr="127.0.0.1", master_port=infra.free_port(), spec=spec, spec_hash=spec.spec_hash(),
        start_checkpoint=start,
    )
    await rig.publisher.publish(event)
    return event


@pytest.fixture
def stack_state() -> Iterator[Path]:
    """A local stack's state directory (Redis' AOF in it, world-readable) outside /tmp and any home (which every
    sandbox covers anyway), like a checkout under /work or /srv: what `make up` hides (TRAINYARD_SANDBOX_HIDE)."""
    root = Path(tempfile.mkdtemp(prefix="trainyard-stack-state-", dir="/var/tmp"))
    root.chmod(0o755)
    aof = root / "redis" / "appendonly.aof"
    aof.parent.mkdir()
    aof.write_text("AUTH operator s3cr3t")
    aof.chmod(0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def layout(rig: Rig) -> ArtifactLayout:
    return ArtifactLayout(rig.env["artifact_root"])


def start_agent(rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **extra: Any) -> Any:
    # what an operator's environment may hold: none of it may reach a rank
    monkeypatch.setenv("REDIS_URL", "redis://:s3cr3t@127.0.0.1:6390/0")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", rig.env["kafka_bootstrap"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer s3cr3t")
    monkeypatch.setenv("HF_TOKEN", "s3cr3t")
    settings = {**rig.agent_settings, "device_count": len(ATTACKS) + 1, "code_cache_dir": tmp_path / "code-cache",
                "node_sandbox": "enforce", **extra}
    return rig.services.start("trainyard_node_agent", "agent", **settings)


async def test_malicious_ranks_are_refused_and_the_victim_of_another_tenant_runs_on(
        rig: Rig, layout: ArtifactLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack_state: Path) -> None:
    dataset = layout.dataset_dir("tinycorpus", "v1")  # make_spec's
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_text('{"the": "manifest"}')
    agent = start_agent(rig, tmp_path, monkeypatch, sandbox_hide=str(stack_state))
    (beat,) = await rig.tap.wait(NodeHeartbeat, node_id=NODE, timeout_s=90)
    assert beat.sandbox == "enforce"

    victim_code = store_archive(layout, VICTIM_TENANT, tmp_path / "victim", {"main.py": VICTIM})
    await gang(rig, "victim", VICTIM_TENANT, 0, code_spec(victim_code, {"SECRET": SECRET}))
    (victim,) = await rig.tap.wait(WorkerStarted, job_id="victim", timeout_s=60)
    victim_out = layout.checkpoints_dir(VICTIM_TENANT, "victim")
    shard = victim_out / "step-000000001-a1" / "shard-rank0.pt"

    async def victim_ready() -> bool:
        return (victim_out / "ready").exists()

    await poll(victim_ready, f"the victim to write its shard:\n{rig.services.log('agent')}")
    assert (victim_out / "ready").read_text() == '{"the": "manifest"}'
    victim_uid = int(os.stat(f"/proc/{victim.pid}").st_uid)
    assert victim_uid >= 1_000_000_000, "the victim runs as its job's own unprivileged user"

    attacker_code = store_archive(layout, ATTACKER_TENANT, tmp_path / "attacker", {"main.py": ATTACKER})
    victim_tree = tmp_path / "code-cache" / victim_code.removeprefix("sha256:") / "tree"
    common = {"VICTIM_TENANT": VICTIM_TENANT, "VICTIM_PID": str(victim.pid), "AGENT_PID": str(agent.pid),
              "NODE": NODE, "VICTIM_TREE": str(victim_tree),
              "STACK_AOF": str(stack_state / "redis" / "appendonly.aof"),
              "BROKER_PORT": rig.env["kafka_bootstrap"].rpartition(":")[2]}
    for device, attack in enumerate(ATTACKS, start=1):
        await gang(rig, f"attack-{attack.replace('_', '-')}", ATTACKER_TENANT, device,
                   code_spec(attacker_code, {**common, "ATTACK": attack}))
    exits = {e.job_id.removeprefix("attack-").replace("-", "_"): e
             for e in await rig.tap.wait(WorkerExited, len(ATTACKS), timeout_s=120)
             if e.job_id.startswith("attack-")}
    assert set(exits) == set(ATTACKS)

    outcomes = {}
    for attack in ATTACKS:
        out = layout.checkpoints_dir(ATTACKER_TENANT, f"attack-{attack.replace('_', '-')}") / "outcome.json"
        outcomes[attack] = json.loads(out.read_text()) if out.exists() else {"missing": str(out)}
    breaches = {a: o for a, o in outcomes.items() if "refused" not in o}
    assert not breaches, breaches
    assert "Read-only file system" in outcomes["write_dataset"]["refused"]
    print(json.dumps(outcomes, indent=1))  # what each attack ran into (shown with -s)
    # every attack failed its own rank, and the platform says so
    assert {a: (e.exit_code, e.reason) for a, e in exits.items()} == {a: (1, "error") for a in ATTACKS}, exits

    # the victim was never touched: alive, its shard intact, and it ends ok once released
    assert shard.read_text() == SECRET
    assert not (shard.parent / "evil.pt").exists()
    assert agent.poll() is None, "the node agent survived"
    assert rig.tap.events(WorkerExited, job_id="victim") == []
    (victim_out / "release").write_text("")
    (done,) = await rig.tap.wait(WorkerExited, job_id="victim", timeout_s=60)
    assert (done.exit_code, done.reason) == (0, "ok"), done
    assert "victim done True" in layout.rank_log(VICTIM_TENANT, "victim", 1, 0).read_text()
    # what a rank writes belongs to its job's user, not to root
    assert os.stat(shard).st_uid == victim_uid
    await LeaseManager(rig.redis).release("victim-a1", done.epoch, [Device(NODE, 0)])


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


MAIN = (_member("main.py"), b"print('should never run')\n")


@pytest.mark.parametrize(("name", "member"), [
    ("absolute-symlink", (_member("data", tarfile.SYMTYPE, "/"), None)),
    ("symlink-out-of-the-tree", (_member("up", tarfile.SYMTYPE, "../../../.."), None)),
    ("hardlink-to-a-host-file", (_member("passwd", tarfile.LNKTYPE, "/etc/passwd"), None)),
    ("dot-dot-path", (_member("../../escaped.py"), b"x = 1\n")),
    ("absolute-path", (_member("/tmp/escaped-by-archive.py"), b"x = 1\n")),
])
async def test_a_code_archive_that_escapes_its_tree_is_refused_before_anything_runs(
        rig: Rig, layout: ArtifactLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str,
        member: tuple[tarfile.TarInfo, bytes | None]) -> None:
    start_agent(rig, tmp_path, monkeypatch)
    await heartbeat_after(rig.tap)
    archive = store_bytes(layout, ATTACKER_TENANT, _tar(MAIN, member))
    await gang(rig, f"escape-{name}", ATTACKER_TENANT, 0, code_spec(archive, {}))
    (exited,) = await rig.tap.wait(WorkerExited, job_id=f"escape-{name}", timeout_s=60)
    assert exited.reason == "config", exited
    assert "outside" in (exited.detail or "") or "not" in (exited.detail or ""), exited
    log = layout.rank_log(ATTACKER_TENANT, f"escape-{name}", 1, 0)
    assert not log.exists() or "should never run" not in log.read_text()
    assert not Path("/tmp/escaped-by-archive.py").exists()
    assert not any((tmp_path / "code-cache").rglob("escaped.py"))
    assert not (tmp_path / "escaped.py").exists()


# initFrom: the start checkpoint of another job is readable, read-only, and nothing else of that job is seen.
INIT_FROM = r"""
import json, os, pathlib, sys
allocation = json.loads(pathlib.Path(os.environ["TRAINYARD_ALLOCATION_FILE"]).read_text())
start = pathlib.Path(allocation["startCheckpoint"]["manifestUri"].removeprefix("file://")).parent
seen = {"manifest": json.loads((start / "manifest.json").read_text()), "siblings": os.listdir(start.parent)}
try:
    (start / "manifest.json").write_text("{}")
    seen["write"] = "written"
except OSError as exc:
    seen["write"] = f"{type(exc).__name__}: {exc}"
own = pathlib.Path(os.environ["TRAINYARD_ARTIFACT_ROOT"], "tenants", os.environ["TRAINYARD_TENANT"], "jobs",
                   os.environ["TRAINYARD_JOB_ID"], "checkpoints")
own.mkdir(parents=True, exist_ok=True)
(own / "seen.json").write_text(json.dumps(seen))
"""


async def test_an_init_from_checkpoint_of_another_job_is_read_only_and_alone(
        rig: Rig, layout: ArtifactLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = layout.checkpoints_dir(ATTACKER_TENANT, "base-job")
    for step in (10, 20):
        (base / f"step-{step:09d}-a1").mkdir(parents=True)
        (base / f"step-{step:09d}-a1" / "manifest.json").write_text(json.dumps({"step": step}))
    start_agent(rig, tmp_path, monkeypatch)
    await heartbeat_after(rig.tap)
    code = store_archive(layout, ATTACKER_TENANT, tmp_path / "init", {"main.py": INIT_FROM})
    event = await gang(rig, "fine-tune", ATTACKER_TENANT, 0, code_spec(code, {}),
                       start=CheckpointRef(manifest_uri=path_to_uri(base / "step-000000020-a1" / "manifest.json"),
                                           global_step=20, attempt=1))
    (exited,) = await rig.tap.wait(WorkerExited, job_id="fine-tune", timeout_s=60)
    assert (exited.exit_code, exited.reason) == (0, "ok"), exited
    seen = json.loads((layout.checkpoints_dir(ATTACKER_TENANT, "fine-tune") / "seen.json").read_text())
    assert seen["manifest"] == {"step": 20}
    assert seen["siblings"] == ["step-000000020-a1"], "the base job's other checkpoints stay hidden"
    assert "Read-only file system" in seen["write"], seen
    assert json.loads((base / "step-000000020-a1" / "manifest.json").read_text()) == {"step": 20}
    await LeaseManager(rig.redis).release(event.allocation_id, event.epoch, [Device(NODE, 0)])


# initFrom.huggingFace: the directory is readable, read-only, and alone; one that resolves into another tenant is
# not shown at all (the agent binds only a directory inside the job's tenant prefix).
HF_START = r"""
import json, os, pathlib
allocation = json.loads(pathlib.Path(os.environ["TRAINYARD_ALLOCATION_FILE"]).read_text())
tenant_dir = pathlib.Path(os.environ["TRAINYARD_ARTIFACT_ROOT"], "tenants", os.environ["TRAINYARD_TENANT"])
start = tenant_dir / allocation["spec"]["initFrom"]["huggingFace"]
seen = {}
try:
    start = start.resolve()
    seen["config"] = json.loads((start / "config.json").read_text())
    seen["siblings"] = sorted(os.listdir(start.parent))
    try:
        (start / "config.json").write_text("{}")
        seen["write"] = "written"
    except OSError as exc:
        seen["write"] = f"{type(exc).__name__}: {exc}"
except OSError as exc:
    seen["error"] = f"{type(exc).__name__}"
own = tenant_dir / "jobs" / os.environ["TRAINYARD_JOB_ID"] / "checkpoints"
own.mkdir(parents=True, exist_ok=True)
(own / "seen.json").write_text(json.dumps(seen))
"""


async def test_a_hugging_face_start_is_read_only_and_alone_and_never_another_tenants(
        rig: Rig, layout: ArtifactLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for tenant, name in ((ATTACKER_TENANT, "mine"), (ATTACKER_TENANT, "other-of-mine"), (VICTIM_TENANT, "secret")):
        layout.model_dir(tenant, name).mkdir(parents=True)
        (layout.model_dir(tenant, name) / "config.json").write_text(json.dumps({"name": name}))
    (layout.tenant_dir(ATTACKER_TENANT) / "models" / "borrowed").symlink_to(layout.model_dir(VICTIM_TENANT, "secret"))
    start_agent(rig, tmp_path, monkeypatch)
    await heartbeat_after(rig.tap)
    code = store_archive(layout, ATTACKER_TENANT, tmp_path / "hf", {"main.py": HF_START})
    events = []
    for device, (job, directory) in enumerate((("hf-own", "models/mine"), ("hf-borrowed", "models/borrowed"))):
        spec = code_spec(code, {}).model_copy(update={"init_from": InitFrom(hugging_face=directory)})
        events.append(await gang(rig, job, ATTACKER_TENANT, device, spec))
        (exited,) = await rig.tap.wait(WorkerExited, job_id=job, timeout_s=60)
        assert (exited.exit_code, exited.reason) == (0, "ok"), exited
    own = json.loads((layout.checkpoints_dir(ATTACKER_TENANT, "hf-own") / "seen.json").read_text())
    assert own["config"] == {"name": "mine"}
    assert own["siblings"] == ["mine"], "the tenant's other models stay hidden"
    assert "Read-only file system" in own["write"], own
    borrowed = json.loads((layout.checkpoints_dir(ATTACKER_TENANT, "hf-borrowed") / "seen.json").read_text())
    assert borrowed == {"error": "FileNotFoundError"}, borrowed  # the victim's directory is not there at all
    assert json.loads((layout.model_dir(VICTIM_TENANT, "secret") / "config.json").read_text()) == {"name": "secret"}
    for device, event in enumerate(events):
        await LeaseManager(rig.redis).release(event.allocation_id, event.epoch, [Device(NODE, device)])


async def test_a_start_checkpoint_swapped_for_a_link_to_another_tenants_is_never_bound(
        rig: Rig, layout: ArtifactLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank of the base job (its checkpoint directory is its user's) swaps the step directory a fine-tune of its
    tenant starts from for a link to another tenant's checkpoint, after the scheduler chose it: the fine-tune's
    sandbox opens its binds from the artifact root without following a link, so it is refused (``security``),
    never bound — before, the link was followed as root and the victim's checkpoint was readable."""
    victim_step = layout.checkpoints_dir(VICTIM_TENANT, "victim-job") / "step-000000010-a1"
    victim_step.mkdir(parents=True)
    (victim_step / "manifest.json").write_text(json.dumps({"victim": SECRET}))
    base = layout.checkpoints_dir(ATTACKER_TENANT, "base-job")
    base.mkdir(parents=True)
    (base / "step-000000020-a1").symlink_to(victim_step, target_is_directory=True)
    start_agent(rig, tmp_path, monkeypatch)
    await heartbeat_after(rig.tap)
    code = store_archive(layout, ATTACKER_TENANT, tmp_path / "init", {"main.py": INIT_FROM})
    event = await gang(rig, "fine-tune", ATTACKER_TENANT, 0, code_spec(code, {}),
                       # the URI the scheduler hands out names the base job's directory (path_to_uri would
                       # resolve the link here, where the swap happens after the choice)
                       start=CheckpointRef(manifest_uri=f"file://{base}/step-000000020-a1/manifest.json",
                                           global_step=20, attempt=1))
    (exited,) = await rig.tap.wait(WorkerExited, job_id="fine-tune", timeout_s=60)
    assert exited.reason == "security", exited
    assert "step-000000020-a1" in (exited.detail or "") and "never followed" in (exited.detail or ""), exited
    assert not (layout.checkpoints_dir(ATTACKER_TENANT, "fine-tune") / "seen.json").exists(), "the rank never ran"
    assert json.loads((victim_step / "manifest.json").read_text()) == {"victim": SECRET}
    await LeaseManager(rig.redis).release(event.allocation_id, event.epoch, [Device(NODE, 0)])
