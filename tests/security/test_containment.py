"""An attempt is contained as a whole, against a real sandboxed node agent (TRAINYARD_NODE_SANDBOX=enforce),
the real broker and Redis, as real processes:

- a rank that double-forks a ``setsid`` survivor squatting a port, and exits 0: once the attempt ends,
  nothing of the job runs on the node any more, the port is free and the attempt's cgroup is gone (the
  survivor had left the rank's process group, which is all the agent used to kill);
- ``/dev/shm``: what the attacker plants there is not in the victim's nor the host's, is gone after the
  attempt, and writing past the attempt's size fails with ENOSPC;
- seccomp: inside a rank, a user namespace (``unshare``, ``unshare -U``), ``ptrace`` of its own child and
  ``mount`` fail with EPERM, while threads and subprocesses work;
- a fork bomb stops at the attempt's pids limit, the agent keeps heartbeating, and the attempt is killed
  as a unit.

All the while a victim job of another tenant runs on the same node and ends ``ok``. Outcomes, never durations.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

import pytest
from trainyard_cli import infra
from trainyard_contract.events import NodeHeartbeat, WorkerExited, WorkerStarted
from trainyard_contract.storage import ArtifactLayout
from trainyard_node_agent import cgroups
from trainyard_node_agent.sandbox import job_uid

from tests.integration.test_node_agent import reap_ranks  # noqa: F401 - autouse: no rank outlives a test
from tests.integration.test_node_agent_failures import NODE, Rig, heartbeat_after, rig  # noqa: F401 - fixture
from tests.integration.test_scheduler_stack import poll
from tests.security.test_rank_sandbox import VICTIM_TENANT, code_spec, gang, start_agent, store_archive
from tests.support.responsiveness import report

pytestmark = [pytest.mark.integration, pytest.mark.security, pytest.mark.slow]

ATTACKER_TENANT = "t1"
SHM_BYTES = 4 * 2**20
PIDS_MAX = 64
# Plants a file in its /dev/shm, notes what it sees there now and then, and exits 0 once released.
VICTIM = r"""
import json, os, pathlib, time
out = pathlib.Path(os.environ["TRAINYARD_ARTIFACT_ROOT"], "tenants", os.environ["TRAINYARD_TENANT"], "jobs",
                   os.environ["TRAINYARD_JOB_ID"], "checkpoints")
out.mkdir(parents=True, exist_ok=True)
pathlib.Path("/dev/shm/victim-buffer").write_text("the victim's")
while not (out / "release").exists():
    (out / "shm.tmp").write_text(json.dumps(sorted(os.listdir("/dev/shm"))))
    os.replace(out / "shm.tmp", out / "shm.json")
    time.sleep(0.2)
(out / "shm.json").write_text(json.dumps(sorted(os.listdir("/dev/shm"))))
ok = pathlib.Path("/dev/shm/victim-buffer").read_text() == "the victim's"
print("victim done", ok, flush=True)
raise SystemExit(0 if ok else 1)
"""
# One attack per job (ATTACK); what it saw goes to outcome.json in its checkpoint prefix; then it waits for
# the test to drop ``release`` there and exits 0.
ATTACKER = r"""
import ctypes, json, os, pathlib, shutil, subprocess, sys, threading, time
env = os.environ
own = pathlib.Path(env["TRAINYARD_ARTIFACT_ROOT"], "tenants", env["TRAINYARD_TENANT"], "jobs", env["TRAINYARD_JOB_ID"],
                   "checkpoints")
own.mkdir(parents=True, exist_ok=True)
libc = ctypes.CDLL(None, use_errno=True)

def errno_of(result):
    return 0 if result == 0 else ctypes.get_errno()

SQUAT = "import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', int(sys.argv[1])))\ns.listen()\n" \
        "while True: time.sleep(1)"

def survivor():  # double-forked, out of the rank's session and process group, squatting a port
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", SQUAT, env["SQUAT_PORT"]])
        os._exit(0)
    os.wait()
    import socket
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", int(env["SQUAT_PORT"])), timeout=1).close()
            return {"survivor": "listening"}
        except OSError:
            time.sleep(0.1)
    return {"survivor": "never listened"}

def shm():
    pathlib.Path("/dev/shm/planted").write_text("the attacker's")
    os.symlink("/tmp/captured", "/dev/shm/victim-buffer")
    fill = None
    try:
        with open("/dev/shm/fill", "wb") as fh:
            for _ in range(int(env["SHM_BYTES"]) // 2**20 * 2):
                fh.write(b"x" * 2**20)
                fh.flush()
    except OSError as exc:
        fill = exc.errno
    os.unlink("/dev/shm/fill")
    return {"listing": sorted(os.listdir("/dev/shm")), "fill": fill}

def seccomp():
    seen = {"unshare_user": errno_of(libc.unshare(0x10000000)), "unshare_net": errno_of(libc.unshare(0x40000000))}
    if shutil.which("unshare"):
        done = subprocess.run(["unshare", "-U", "true"], capture_output=True, text=True)
        seen["unshare_cmd"] = done.returncode != 0 and "Operation not permitted" in done.stderr
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    seen["ptrace_child"] = errno_of(libc.ptrace(16, child, None, None))  # PTRACE_ATTACH: same uid
    os.kill(child, 9)
    os.waitpid(child, 0)
    scratch = env["HOME"]
    seen["mount"] = errno_of(libc.mount(b"none", scratch.encode(), b"tmpfs", 0, None))
    box = []
    t = threading.Thread(target=lambda: box.append("ran"))
    t.start(); t.join()
    seen["thread"] = box == ["ran"]
    seen["subprocess"] = subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
    return seen

def forkbomb():
    forked, refused = 0, None
    while forked < 100_000:
        try:
            pid = os.fork()
        except OSError as exc:
            refused = exc.errno
            break
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        forked += 1
    return {"forked": forked, "refused": refused}

outcome = globals()[env["ATTACK"]]()
(own / "outcome.json").write_text(json.dumps(outcome))
print(json.dumps(outcome), flush=True)
while not (own / "release").exists():
    time.sleep(0.2)
"""
ATTACKS = ("survivor", "shm", "seccomp", "forkbomb")


def job_processes(uid: int) -> list[int]:
    """The live (not zombie) processes on this host running as ``uid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith(("Z", "X")):
            found.append(int(entry))
    return found


def attempt_cgroup(rig: Rig, job_id: str) -> Path:
    """The attempt's cgroup in the hierarchy the agent kills it through (the agent is this process's child)."""
    layout, own = cgroups.host_layout()
    shm_root = Path(rig.env["artifact_root"]).resolve() / "nodes" / NODE / "shm"
    plan = cgroups.plan(layout, own, cgroups.attempt_name(job_id, 1), cgroups.Limits(),
                        cgroups.agent_root(NODE, shm_root))
    return plan.dirs[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="a sandboxed node agent runs as root (CI does)")
async def test_nothing_of_an_attempt_outlives_it_and_its_shm_seccomp_and_pids_limit_hold(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = ArtifactLayout(rig.env["artifact_root"])
    dataset = layout.dataset_dir("tinycorpus", "v1")  # make_spec's
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_text("{}")
    agent = start_agent(rig, tmp_path, monkeypatch, attempt_shm_bytes=SHM_BYTES, attempt_pids_max=PIDS_MAX)
    await heartbeat_after(rig.tap)
    victim_code = store_archive(layout, VICTIM_TENANT, tmp_path / "victim", {"main.py": VICTIM})
    await gang(rig, "victim", VICTIM_TENANT, 0, code_spec(victim_code, {}))
    try:
        await rig.tap.wait(WorkerStarted, job_id="victim", timeout_s=60)
    except AssertionError as exc:
        raise AssertionError(rig.services.log("agent")[-6000:]) from exc
    victim_out = layout.checkpoints_dir(VICTIM_TENANT, "victim")

    code = store_archive(layout, ATTACKER_TENANT, tmp_path / "attacker", {"main.py": ATTACKER})
    jobs = {attack: f"contain-{attack}" for attack in ATTACKS}
    squat = infra.free_port()
    for device, attack in enumerate(ATTACKS, start=1):
        await gang(rig, jobs[attack], ATTACKER_TENANT, device,
                   code_spec(code, {"ATTACK": attack, "SHM_BYTES": str(SHM_BYTES), "SQUAT_PORT": str(squat)}))
    outcomes = {}
    for attack, job in jobs.items():
        out = layout.checkpoints_dir(ATTACKER_TENANT, job) / "outcome.json"

        async def written(out: Path = out) -> bool:
            return out.exists()

        await poll(written, f"{job} to report:\n{rig.services.log('agent')[-4000:]}")
        outcomes[attack] = json.loads(out.read_text())

    # (a) the survivor runs, as the job's user, in the attempt's cgroup, and holds the port
    assert outcomes["survivor"] == {"survivor": "listening"}, outcomes["survivor"]
    survivor_uid = job_uid(jobs["survivor"], first=1_000_000_000, count=2**20)
    survivors = job_processes(survivor_uid)
    cgroup = attempt_cgroup(rig, jobs["survivor"])
    assert survivors and set(survivors) <= {int(p) for p in (cgroup / "cgroup.procs").read_text().split()}

    # (c) no namespaces, no ptrace, no mount — threads and subprocesses still run
    seen = outcomes["seccomp"]
    assert seen["unshare_user"] == seen["unshare_net"] == errno.EPERM, seen
    assert seen["ptrace_child"] == errno.EPERM and seen["mount"] == errno.EPERM, seen
    assert seen.get("unshare_cmd", True) is True and seen["thread"] and seen["subprocess"], seen

    # (b) the attacker's /dev/shm is its own and size-limited; the victim's holds only the victim's
    assert outcomes["shm"]["fill"] == errno.ENOSPC, outcomes["shm"]
    assert set(outcomes["shm"]["listing"]) == {"planted", "victim-buffer"}, outcomes["shm"]
    shm_dir = Path(rig.env["artifact_root"]).resolve() / "nodes" / NODE / "shm" / cgroups.attempt_name(jobs["shm"], 1)
    assert not Path("/dev/shm/planted").exists()  # the attempt's own tmpfs, never the host's /dev/shm

    # (d) the fork bomb stopped at the limit, and the agent heartbeats on while it holds it
    bomb = outcomes["forkbomb"]
    assert bomb["refused"] == errno.EAGAIN and 0 < bomb["forked"] < PIDS_MAX, bomb
    beats = len(rig.tap.events(NodeHeartbeat, node_id=NODE))
    await rig.tap.wait(NodeHeartbeat, beats + 2, node_id=NODE, timeout_s=60)
    assert agent.poll() is None, "the node agent survived"
    report("survivor, /dev/shm, seccomp and fork-bomb attacks", rig.tap, NODE,
           float(rig.agent_settings["heartbeat_s"]))  # type: ignore[arg-type]  # the rig's setting

    for job in jobs.values():
        (layout.checkpoints_dir(ATTACKER_TENANT, job) / "release").write_text("")
    exits = {e.job_id: e for e in await rig.tap.wait(WorkerExited, len(jobs), timeout_s=120)
             if e.job_id in jobs.values()}
    assert {j: (e.exit_code, e.reason) for j, e in exits.items()} == {j: (0, "ok") for j in jobs.values()}, exits

    for job in jobs.values():
        uid = job_uid(job, first=1_000_000_000, count=2**20)

        async def ended(uid: int = uid, job: str = job) -> bool:
            return not job_processes(uid) and not attempt_cgroup(rig, job).exists()

        await poll(ended, f"{job}'s processes and cgroup to be gone: {job_processes(uid)}")
    assert not any(Path(f"/proc/{pid}").exists() and pid in job_processes(survivor_uid) for pid in survivors)
    with socket.socket() as free:  # the port it squatted is free again for the next job
        free.bind(("127.0.0.1", squat))
    assert not shm_dir.exists(), "the attempt's /dev/shm is unmounted and removed"

    # the victim never saw the attacker's files, and ends ok with its own buffer intact
    assert json.loads((victim_out / "shm.json").read_text()) == ["victim-buffer"]
    (victim_out / "release").write_text("")
    (done,) = await rig.tap.wait(WorkerExited, job_id="victim", timeout_s=60)
    assert (done.exit_code, done.reason) == (0, "ok"), (done, rig.services.log("agent")[-3000:])
    assert json.loads((victim_out / "shm.json").read_text()) == ["victim-buffer"]
