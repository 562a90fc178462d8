"""The sandbox's pure part: a job's uid, the environment scrub, what a rank's plan binds where, who owns
what; and the plan's round trip through the wrapper's command line. As root: the wrapper's PID namespace
(exit status passed through, nothing left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from trainyard_node_agent import sandbox as sb
from trainyard_node_agent.settings import NodeAgentSettings

ROOT = Path("/srv/artifacts")
ATTEMPT = ROOT / "tenants/acme/jobs/j1/attempts/2"
VIEW = sb.RankView(
    attempt_dir=ATTEMPT, checkpoints=ROOT / "tenants/acme/jobs/j1/checkpoints", scratch=ATTEMPT / "scratch/rank-0",
    datasets=(ROOT / "datasets/corpus/v1",), code_dir=Path("/var/cache/code/abc/tree"),
    cwd=Path("/var/cache/code/abc/tree/src"), calibration=ROOT / "calibration",
    runtime=(Path("/opt/venv"), Path("/root/.pyenv/versions/3.11.7")),
)
HIDDEN = (ROOT, Path("/var/cache/code"), ROOT / "nodes/n1", Path("/root"))


def test_a_jobs_uid_is_the_same_everywhere_and_inside_the_range() -> None:
    uids = {sb.job_uid(f"job-{i}", first=1_000_000, count=1000) for i in range(200)}
    assert all(1_000_000 <= u < 1_001_000 for u in uids)
    assert len(uids) > 150  # spread, not one bucket
    assert sb.job_uid("j1", first=5000, count=1 << 20) == sb.job_uid("j1", first=5000, count=1 << 20)


def test_a_uid_clash_names_the_other_live_job_never_the_same_one() -> None:
    assert sb.uid_clash("a", 7, {"a": 7, "b": 8}) is None
    assert sb.uid_clash("a", 7, {"b": 7, "c": 7}) == "b"
    assert sb.uid_clash("a", 7, {}) is None


@pytest.mark.parametrize(("name", "value", "secret"), [
    ("TRAINYARD_REDIS_URL", "redis://127.0.0.1:6390/0", True),
    ("REDIS_URL", "redis://:pw@h/0", True),
    ("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092", True),
    ("BOOTSTRAP", "h:9092", True),
    ("AWS_SECRET_ACCESS_KEY", "x", True),
    ("AWS_REGION", "eu-west-1", True),
    ("HF_TOKEN", "x", True),
    ("DB_PASSWORD", "x", True),
    ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer x", True),
    ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "a=b", True),
    ("SSH_AUTH_SOCK", "/tmp/ssh", True),
    ("SIGNING_KEY", "x", True),
    ("MY_MIRROR", "https://user:pw@mirror.example/simple", True),
    ("CACHE", "rediss://cache:6380", True),
    ("PATH", "/usr/bin:/bin", False),
    ("HOME", "/root", False),
    ("OMP_NUM_THREADS", "1", False),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318", False),
    ("PYTHONPATH", "/work/libs", False),
    ("LANG", "C.UTF-8", False),
    ("KEYBOARD", "us", False),
])
def test_secret_looking_variables_are_scrubbed(name: str, value: str, secret: bool) -> None:
    env, removed = sb.scrub_env({name: value, "PATH": "/bin"})
    assert (name in removed) is secret
    assert env.get("PATH") == "/bin"


def test_the_plan_covers_the_hidden_roots_and_binds_back_only_the_ranks_paths() -> None:
    plan = sb.plan_rank(VIEW, uid=1234, gid=1234, hidden=HIDDEN, start_error_file=ATTEMPT / "exit/rank-0.start-error")
    assert plan.cover == (("/root", 0o755), ("/tmp", 0o1777), ("/srv/artifacts", 0o755), ("/var/cache/code", 0o755))
    binds = {b.path: (b.writable, b.optional) for b in plan.binds}
    assert binds == {
        "/root/.pyenv/versions/3.11.7": (False, True),  # the interpreter, under the hidden home
        "/var/cache/code/abc/tree": (False, False),  # its own code tree, no other
        str(ROOT / "datasets/corpus/v1"): (False, True),
        str(ROOT / "calibration"): (False, True),
        str(VIEW.checkpoints): (True, False),
        str(ATTEMPT): (True, False),
        str(VIEW.scratch): (True, False),
    }  # /opt/venv is not hidden: nothing to bind back
    depths = [len(Path(b.path).parts) for b in plan.binds]
    assert depths == sorted(depths), "parents before children"
    assert (plan.uid, plan.gid, plan.cwd) == (1234, 1234, "/var/cache/code/abc/tree/src")
    assert plan.env["HOME"] == str(VIEW.scratch)
    assert not any(b.path == str(ROOT / "nodes/n1") for b in plan.binds)


def test_a_start_checkpoint_of_another_job_is_bound_read_only_and_the_own_prefix_not_twice() -> None:
    other = ROOT / "tenants/acme/jobs/base/checkpoints/step-000000100-a1"
    plan = sb.plan_rank(sb.RankView(**{**VIEW.__dict__, "start_checkpoint": other}), uid=1, gid=1, hidden=HIDDEN)
    assert sb.Bind(str(other), writable=False, optional=True) in plan.binds
    own = VIEW.checkpoints / "step-000000005-a1"
    plan = sb.plan_rank(sb.RankView(**{**VIEW.__dict__, "start_checkpoint": own}), uid=1, gid=1, hidden=HIDDEN)
    assert not any(b.path == str(own) for b in plan.binds)


def test_the_built_in_trainer_runs_in_its_scratch_without_a_code_tree() -> None:
    view = sb.RankView(attempt_dir=ATTEMPT, checkpoints=VIEW.checkpoints, scratch=VIEW.scratch)
    plan = sb.plan_rank(view, uid=1, gid=1, hidden=(ROOT,), private_tmp=False)
    assert plan.cwd == str(VIEW.scratch)
    assert plan.cover == (("/srv/artifacts", 0o755),)
    assert {b.path for b in plan.binds} == {str(VIEW.checkpoints), str(ATTEMPT), str(VIEW.scratch)}


def test_the_plan_survives_the_wrappers_command_line() -> None:
    plan = sb.plan_rank(VIEW, uid=7, gid=8, hidden=HIDDEN, start_error_file=Path("/x/rank-0.start-error"))
    assert sb.SandboxPlan.from_json(plan.to_json()) == plan
    command = sb.wrap(["python", "train.py"], plan)
    assert command[1:3] == ["-I", str(sb.WRAPPER)] and command[4:] == ["--", "python", "train.py"]


def test_root_keeps_the_attempt_directory_and_the_spool_directory_the_rank_owns_its_own_files() -> None:
    events = ATTEMPT / "events/rank-0.jsonl"
    owned = {o.path: (o.uid, o.gid, o.mode, o.directory)
             for o in sb.ownership(VIEW, events_file=events, exit_dir=ATTEMPT / "exit", uid=42, gid=42)}
    assert owned[ATTEMPT] == (0, 42, 0o1775, True)  # sticky: root's allocation file stays root's
    assert owned[ATTEMPT / "exit"] == (0, 42, 0o1775, True)
    assert owned[events.parent] == (0, 0, 0o755, True)  # the spool cannot be swapped for a symlink
    assert owned[events] == (42, 42, 0o644, False)
    assert owned[VIEW.scratch] == (42, 42, 0o700, True)
    assert owned[VIEW.checkpoints] == (42, 42, 0o755, True)


def test_warm_interpreters_work_on_a_sandboxed_node_and_are_sized_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINYARD_WARM_RANKS", raising=False)  # the suite turns them off (tests/conftest.py)
    assert NodeAgentSettings(node_id="n", warm_ranks=2).warm_ranks == 2  # each enters its rank's sandbox
    default = NodeAgentSettings(node_id="n")
    assert default.node_sandbox == "enforce" and default.warm_ranks is None  # None: warmpool.auto_size


def test_a_rank_whose_sandbox_could_not_be_set_up_is_this_nodes_error_not_the_jobs() -> None:
    from trainyard_node_agent.classify import ExitFacts, classify_exit

    line = "sandbox: cannot set up the rank's sandbox: [Errno 1] mount proc on /proc: Operation not permitted"
    facts = ExitFacts(exit_code=sb.SANDBOX_EXIT, log_tail=f"{line}\n", user_code=True)
    assert classify_exit(facts) == ("error", line)


def test_the_import_path_is_bound_back_but_never_a_platform_path(tmp_path: Path) -> None:
    """A checkout under /tmp or the home (editable installs put its sources on sys.path) must stay
    importable in the sandbox; the agent's working directory, which holds its state, must not appear."""
    from trainyard_node_agent.sandbox import runtime_paths

    checkout = tmp_path / "checkout" / "libs" / "trainer" / "src"
    state_parent = tmp_path / "stack"
    (state_parent / ".trainyard" / "artifacts").mkdir(parents=True)
    checkout.mkdir(parents=True)
    hidden = [state_parent / ".trainyard" / "artifacts", state_parent / ".trainyard"]
    found = runtime_paths(hidden, search_path=["", str(checkout), str(state_parent), str(hidden[0] / "x"),
                                               str(tmp_path / "missing")])
    assert checkout.resolve() in found
    assert state_parent.resolve() not in found and (hidden[0] / "x").resolve() not in found
    assert (tmp_path / "missing").resolve() not in found


def test_a_hugging_face_start_directory_is_bound_read_only() -> None:
    weights = ROOT / "tenants/acme/models/tiny"
    plan = sb.plan_rank(sb.RankView(**{**VIEW.__dict__, "start_weights": weights}), uid=1, gid=1, hidden=HIDDEN)
    assert sb.Bind(str(weights), writable=False, optional=True) in plan.binds
    assert not any(b.path == str(ROOT / "tenants/acme/models") for b in plan.binds)  # only that directory
    assert not any(b.path == str(weights) for b in sb.plan_rank(VIEW, uid=1, gid=1, hidden=HIDDEN).binds)


RANK_ENDS = r"""
import os, signal, sys, time
how = sys.argv[1]
if how.startswith("signal-"):
    os.kill(os.getpid(), int(how.removeprefix("signal-")))
    time.sleep(5)
sys.exit(int(how))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="entering a sandbox needs root (CI runs as root)")
@pytest.mark.parametrize(("how", "returncode"), [
    ("0", 0), ("3", 3), ("137", 137),  # an exit code, even one that looks like a signal death, stays one
    (f"signal-{int(signal.SIGKILL)}", -signal.SIGKILL), (f"signal-{int(signal.SIGTERM)}", -signal.SIGTERM),
    (f"signal-{int(signal.SIGSEGV)}", -signal.SIGSEGV),
])
def test_the_wrapper_ends_the_way_the_rank_in_its_pid_namespace_did(tmp_path: Path, how: str,
                                                                    returncode: int) -> None:
    pid_file = tmp_path / "rank.pid"
    plan = sb.SandboxPlan(uid=1_000_000_321, gid=1_000_000_321, cover=(), binds=(), cwd="/", pid_file=str(pid_file))
    done = subprocess.run(sb.wrap(["/usr/bin/env", "python3", "-I", "-c", RANK_ENDS, how], plan),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == returncode, done.stderr
    assert int(pid_file.read_text()) > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="entering a sandbox needs root (CI runs as root)")
def test_a_rank_is_pid_2_of_its_namespace_and_what_it_leaves_behind_dies_with_it(tmp_path: Path) -> None:
    """A double-forked, setsid survivor is killed when the rank ends; the pid file names the rank (the
    host's number), which is the job's user."""
    script = ("import os, sys, time\n"
              "print(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), flush=True)\n"
              "if os.fork() == 0:\n"
              "    os.setsid()\n"
              "    if os.fork() == 0:\n"
              "        open(sys.argv[1], 'w').write('x'); time.sleep(60)\n"
              "    os._exit(0)\n"
              "time.sleep(1)\n")
    shared = Path(tempfile.mkdtemp(prefix="trainyard-survivor-", dir="/tmp"))
    shared.chmod(0o777)  # the job's user writes its marker there
    marker = shared / "survivor"
    plan = sb.SandboxPlan(uid=1_000_000_321, gid=1_000_000_321, cover=(), binds=(), cwd="/",
                          pid_file=str(tmp_path / "rank.pid"))
    proc = subprocess.Popen(sb.wrap(["/usr/bin/env", "python3", "-I", "-c", script, str(marker)], plan),
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split(" ", 1) == ["2", "[2]\n"], out  # pid 1 (root) is hidden too
    assert marker.exists()
    rank = int((tmp_path / "rank.pid").read_text())
    assert not Path(f"/proc/{rank}").exists()
    survivors = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).endswith(str(marker))]
    assert survivors == [], survivors
    marker.unlink()
    shared.rmdir()


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


# ----------------------------------------------------------------------------- binds opened from their anchor


@pytest.mark.parametrize(("path", "anchors", "expected"), [
    ("/art/tenants/t/jobs/j/checkpoints", ["/art"], "/art"),
    ("/art/tenants/t/jobs/j/checkpoints", ["/art", "/art/tenants/t"], "/art/tenants/t"),  # the innermost
    ("/art", ["/art"], "/art"),
    ("/artifacts-2/x", ["/art"], None),  # a name that starts the same is not under it
    ("/usr/lib/python3", ["/art"], None),  # the interpreter's prefixes: opened as they are
])
def test_a_bind_is_anchored_at_the_innermost_platform_directory_holding_it(
        path: str, anchors: list[str], expected: str | None) -> None:
    assert sb.anchor_of(Path(path), [Path(a) for a in anchors]) == expected


def test_a_rank_owned_bind_is_opened_from_its_anchor_never_through_a_link(tmp_path: Path) -> None:
    (tmp_path / "jobs" / "base" / "step").mkdir(parents=True)
    (tmp_path / "jobs" / "base" / "file").write_text("x")
    (tmp_path / "victim").mkdir()
    (tmp_path / "jobs" / "swapped").symlink_to(tmp_path / "victim", target_is_directory=True)
    (tmp_path / "jobs" / "above").symlink_to(tmp_path / "jobs" / "base", target_is_directory=True)
    anchored = str(tmp_path)
    for fine in ("jobs/base/step", "jobs/base/file", "."):
        fd = sb.open_bind_source(sb.Bind(str(tmp_path / fine), anchor=anchored))
        assert os.readlink(f"/proc/self/fd/{fd}") == str((tmp_path / fine).resolve())
        os.close(fd)
    for refused in ("jobs/swapped", "jobs/above/step"):  # the link itself, or a link above the path
        with pytest.raises(OSError, match="symbolic link .*never followed"):
            sb.open_bind_source(sb.Bind(str(tmp_path / refused), anchor=anchored))
    with pytest.raises(FileNotFoundError):  # an optional bind that is not there is skipped, as before
        sb.open_bind_source(sb.Bind(str(tmp_path / "jobs" / "missing"), anchor=anchored))
    fd = sb.open_bind_source(sb.Bind(str(tmp_path / "jobs" / "swapped")))  # no anchor: as it was
    assert os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "victim")
    os.close(fd)


def test_the_anchor_travels_in_the_plan_json() -> None:
    plan = sb.plan_rank(sb.RankView(attempt_dir=Path("/art/a"), checkpoints=Path("/art/c"), scratch=Path("/art/s"),
                                    runtime=(Path("/usr/lib/py"),)),
                        uid=7, gid=7, hidden=[Path("/art"), Path("/usr/lib")], anchors=[Path("/art")])
    again = sb.SandboxPlan.from_json(plan.to_json())
    assert {b.path: b.anchor for b in again.binds} == {"/art/a": "/art", "/art/c": "/art", "/art/s": "/art",
                                                        "/usr/lib/py": None}
