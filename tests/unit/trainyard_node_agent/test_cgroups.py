"""The attempt cgroup's pure part: the layout read from a mount table, and what is created, limited and
killed for one attempt on a pure v2, a hybrid and a v1-only host."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from trainyard_node_agent import cgroups as cg
from trainyard_node_agent import ranks as rp
from trainyard_node_agent.confinement import AttemptScopes
from trainyard_node_agent.settings import NodeAgentSettings

HYBRID = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
V1 = "\n".join(line for line in HYBRID.splitlines() if "cgroup2" not in line)
V1_COMOUNTED = V1.replace("cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0",
                          "cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0")
V2 = "proc /proc proc rw 0 0\ncgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n"
NONE = "proc /proc proc rw 0 0\n"
OWN_HYBRID = "4:memory:/process_api/abc\n8:pids:/\n6:freezer:/\n1:cpu:/\n0::/\n"
OWN_V2 = "0::/system.slice/trainyard-node-agent.service\n"
ROOT = "trainyard/n1-0123abcd"
LIMITS = cg.Limits(pids=4096, memory_bytes=8 * 2**30, cpu_cores=2.5)


@pytest.mark.parametrize(("mounts", "kind", "unified", "v1"), [
    (HYBRID, "hybrid", "/sys/fs/cgroup/unified", {"cpu", "memory", "freezer", "pids"}),
    (V1, "v1", None, {"cpu", "memory", "freezer", "pids"}),
    (V1_COMOUNTED, "v1", None, {"cpu", "memory", "freezer", "pids"}),
    (V2, "v2", "/sys/fs/cgroup", set()),
    (NONE, "none", None, set()),
])
def test_the_layout_is_read_from_the_mount_table(mounts: str, kind: str, unified: str | None, v1: set[str]) -> None:
    layout = cg.detect(cg.parse_mounts(mounts))
    assert layout.kind == kind
    assert layout.unified == (Path(unified) if unified else None)
    assert set(layout.v1) == v1


def test_own_cgroups_are_read_per_hierarchy() -> None:
    own = cg.parse_own("12:cpu,cpuacct:/a\n4:memory:/process_api/abc\n1:name=systemd:/x\n0::/y\n")
    assert own == {"cpu": "/a", "cpuacct": "/a", "memory": "/process_api/abc", "name=systemd": "/x", "": "/y"}


def test_pure_v2_one_cgroup_with_its_controllers_enabled_down_to_it_and_v2_limit_files() -> None:
    layout = cg.detect(cg.parse_mounts(V2))
    plan = cg.plan(layout, cg.parse_own(OWN_V2), "job-1.a2", LIMITS, ROOT)
    here = Path("/sys/fs/cgroup/system.slice/trainyard-node-agent.service/trainyard/n1-0123abcd/job-1.a2")
    assert plan.dirs == (here,)
    assert plan.procs == (here / "cgroup.procs",)
    service = "/sys/fs/cgroup/system.slice/trainyard-node-agent.service"
    assert [(str(f), v) for f, v in plan.enable] == [
        (f"{service}{below}/cgroup.subtree_control", f"+{c}")
        for below in ("", "/trainyard", "/trainyard/n1-0123abcd") for c in ("memory", "pids", "cpu")]
    assert dict(plan.limits) == {here / "pids.max": "4096", here / "memory.max": str(8 * 2**30),
                                 here / "cpu.max": "250000 100000"}
    assert plan.kill_file == here / "cgroup.kill" and plan.freezer is None
    assert plan.oom_files == (here / "memory.events",)


def test_hybrid_kills_through_the_unified_hierarchy_and_limits_through_v1_under_the_agents_own_cgroups() -> None:
    layout = cg.detect(cg.parse_mounts(HYBRID))
    plan = cg.plan(layout, cg.parse_own(OWN_HYBRID), "job-1.a2", LIMITS, ROOT)
    unified = Path("/sys/fs/cgroup/unified/trainyard/n1-0123abcd/job-1.a2")
    memory = Path("/sys/fs/cgroup/memory/process_api/abc/trainyard/n1-0123abcd/job-1.a2")
    pids, cpu = (Path(f"/sys/fs/cgroup/{c}/trainyard/n1-0123abcd/job-1.a2") for c in ("pids", "cpu"))
    assert set(plan.dirs) == {unified, memory, pids, cpu}  # no freezer: cgroup.kill does it
    assert plan.enable == ()
    assert dict(plan.limits) == {pids / "pids.max": "4096", memory / "memory.limit_in_bytes": str(8 * 2**30),
                                 cpu / "cpu.cfs_period_us": "100000", cpu / "cpu.cfs_quota_us": "250000"}
    assert plan.kill_file == unified / "cgroup.kill" and plan.freezer is None
    assert plan.oom_files == (memory / "memory.oom_control",)


def test_v1_only_freezes_to_kill_and_uses_no_cpu_cgroup_without_a_quota() -> None:
    layout = cg.detect(cg.parse_mounts(V1))
    plan = cg.plan(layout, cg.parse_own("4:memory:/\n8:pids:/\n6:freezer:/\n"), "j.a1", cg.Limits(pids=64), ROOT)
    assert {d.parts[4] for d in plan.dirs} == {"memory", "pids", "freezer"}
    assert plan.kill_file is None
    assert plan.freezer == Path("/sys/fs/cgroup/freezer/trainyard/n1-0123abcd/j.a1/freezer.state")
    assert dict(plan.limits) == {Path("/sys/fs/cgroup/pids/trainyard/n1-0123abcd/j.a1/pids.max"): "64"}


def test_no_cgroups_mounted_plans_nothing() -> None:
    plan = cg.plan(cg.detect(cg.parse_mounts(NONE)), {}, "j.a1", LIMITS)
    assert plan.dirs == () and plan.kill_file is None and plan.limits == ()


@pytest.mark.parametrize(("job", "name"), [
    ("job-42", "job-42.a3"),
    ("../../etc", "______etc-"),
    ("a/b", "a_b-"),
])
def test_an_attempts_name_is_one_safe_path_component(job: str, name: str) -> None:
    got = cg.attempt_name(job, 3)
    assert got.startswith(name) and "/" not in got and got.endswith(".a3") and not got.startswith(".")
    assert cg.attempt_name("a/b", 3) != cg.attempt_name("a_b", 3)  # made safe, never merged


def test_each_agent_has_its_own_directory() -> None:
    assert cg.agent_root("n1", Path("/a")) != cg.agent_root("n1", Path("/b"))
    assert cg.agent_root("n1", Path("/a")) == cg.agent_root("n1", Path("/a"))
    assert cg.agent_root("n/1", Path("/a")).count("/") == 1


def test_oom_kills_are_counted_in_the_attempts_cgroup_when_it_has_one(tmp_path: Path) -> None:
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n")
    oom_control = tmp_path / "memory.oom_control"
    oom_control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert rp.oom_kills(None, (events,)) == 2
    assert rp.oom_kills(None, (oom_control,)) == 5
    assert rp.oom_kills(None, (tmp_path / "gone",)) == rp.oom_kills(None)  # no attempt cgroup: the agent's own


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting the attempt's tmpfs needs root (CI runs as root)")
def test_an_agent_closes_the_scopes_it_does_not_adopt_and_keeps_the_adopted_one(tmp_path: Path) -> None:
    """A fake hybrid hierarchy under tmp_path: two attempts opened; the sweep at start-up keeps the adopted
    one's cgroup and /dev/shm and removes the other's; closing the adopted one later removes it too."""
    settings = NodeAgentSettings(node_id="n1", artifact_root=tmp_path / "artifacts")
    scopes = AttemptScopes(settings)
    scopes.layout = cg.Layout("hybrid", tmp_path / "unified",
                              {"pids": tmp_path / "pids", "memory": tmp_path / "memory"})
    scopes.own = {}
    kept, _ = scopes.open("kept", 1, 1_000_000_321)
    gone, _ = scopes.open("gone", 2, 1_000_000_321)
    assert all(d.is_dir() for d in (*kept.dirs, *gone.dirs))
    assert os.path.ismount(scopes.shm_dir("kept", 1)) and os.path.ismount(scopes.shm_dir("gone", 2))
    assert (kept.dirs[1] / "pids.max").read_text() == "4096"  # the default per-attempt limit
    for d in (*kept.dirs, *gone.dirs):  # a real cgroup's interface files go with it; these are plain files
        (d / "pids.max").unlink(missing_ok=True)
    try:
        scopes.sweep({("kept", 1)})
        assert not any(d.exists() for d in gone.dirs) and not scopes.shm_dir("gone", 2).exists()
        assert all(d.is_dir() for d in kept.dirs) and os.path.ismount(scopes.shm_dir("kept", 1))
    finally:
        scopes.close("kept", 1)
    assert not any(d.exists() for d in kept.dirs) and not scopes.shm_dir("kept", 1).exists()


FORK_TREE = r"""
import os, sys, time
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(120)
        os._exit(0)
print("forked", flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/sys/fs/cgroup/freezer/cgroup.procs").exists(),
                    reason="needs root and a v1 freezer hierarchy (this host's kind)")
@pytest.mark.parametrize("through", ["freezer", "cgroup.kill"])
def test_a_whole_process_tree_is_killed_setsid_survivors_included(tmp_path: Path, through: str) -> None:
    import subprocess
    import sys

    layout, own = cg.host_layout()
    if through == "freezer":  # as on a v1-only host: freeze, SIGKILL each pid, thaw
        layout = cg.Layout("v1", None, layout.v1)
    elif layout.unified is None:
        pytest.skip("no cgroup2 hierarchy")
    plan = cg.plan(layout, own, f"killtest.a{os.getpid()}", cg.Limits(pids=64), cg.agent_root("test", tmp_path))
    assert cg.create(plan) == []
    try:
        proc = subprocess.Popen([sys.executable, "-c", FORK_TREE], stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: cg.join(plan.procs))
        assert proc.stdout is not None and proc.stdout.readline().strip() == "forked"
        inside = cg.members(plan)
        assert proc.pid in inside and len(inside) >= 4  # the parent and three setsid grandchildren
        assert cg.kill(plan) and cg.members(plan) == set()
        assert proc.wait(10) == -9
    finally:
        cg.kill(plan)
        assert cg.remove(plan)
    assert not any(d.exists() for d in plan.dirs)
