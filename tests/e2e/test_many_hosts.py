"""Many hosts, really: three simulated hosts, each its own Linux network namespace with its own address
(tests/support/netns.py), a node agent and its ranks in each; the broker, Redis and the services on
this host, reached over the hosts' switch. Nothing talks over loopback across hosts.

One job, a gang of two ranks on two hosts (one CPU device each), rendezvous over TCP (gloo) at the
advertised address of rank 0's host and trains. Then rank 0's host loses its link mid-run:

1. the scheduler stops hearing it, declares it lost, ends the attempt ``lost`` and places a new attempt,
   with a newer epoch, on the two hosts left, which rendezvous at the new rank 0's address and train on;
2. the cut host's rank meanwhile still runs its old attempt, unaware;
3. the link comes back: that agent's stale rank (old epoch) is stopped — its allocation was revoked and
   its device lease released while it was away — and its late reports change nothing: the new attempt
   and its epoch stand, the old one stays ``lost``.

Runs where it is root and namespaces work (CI); skipped elsewhere, saying why.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from tests.chaos.harness import TENANT, ChaosRig, chaos_spec
from tests.support.manyhosts import ManyHostsStack, many_hosts_stack
from tests.support.netns import unavailable
from trainyard_cli.devstack import prepare_and_publish
from trainyard_cli.stack import pid_alive
from trainyard_contract.events import TERMINAL_STATES
from trainyard_contract.records import AttemptRecord, JobRecord

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HOSTS = 3
_why_not = unavailable()
if _why_not:
    pytestmark.append(pytest.mark.skip(reason=_why_not))


def wait_for(what: str, probe, timeout_s: float, every_s: float = 0.5):  # noqa: ANN001, ANN201 - any probe
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := probe():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def rank_hosts(attempt: AttemptRecord) -> dict[int, str]:
    return {r.rank: n.node_id for n in attempt.assignments for r in n.ranks}


def stepping_ranks(rig: ChaosRig, job_id: str, attempt: int, past: int = 0) -> set[int]:
    """Ranks of the attempt whose spool holds a StepMetrics past step ``past``."""
    return {rank for rank, lines in rig.spool_events(job_id, attempt).items()
            if any(p.get("eventType") == "StepMetrics" and p["step"] > past for p in lines)}


def agent_log(stack: ManyHostsStack, node_id: str) -> str:
    return (stack.s.log_dir / f"node-agent-{node_id.rsplit('-', 1)[1]}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a generator fixture
    with many_hosts_stack(tmp_path_factory.mktemp("many-hosts") / ".trainyard", HOSTS) as s:
        prepare_and_publish(s)
        yield s


def test_gang_over_two_hosts_survives_losing_one(stack: ManyHostsStack) -> None:
    rig = ChaosRig(stack, random.Random(0))
    hosts = {f"node-{h.index}": h for h in stack.net.hosts}

    # Every node advertises its own host's address, none a loopback one.
    nodes = {n.node_id: n for n in stack.nodes()}
    assert {n: r.host for n, r in nodes.items()} == {n: h.address for n, h in hosts.items()}

    # two CPU devices with one per host: the gang spans two hosts; it runs until the test is done with it
    job_id = rig.submit(chaos_spec(max_steps=100_000, every=10, name="many-hosts"))

    # 1. The gang spans two hosts, rendezvous at rank 0's host address, and both ranks train.
    first = wait_for("the first attempt placed", lambda: (j := rig.job(job_id)) and j.current, 120)
    placed = rank_hosts(first)
    assert len(set(placed.values())) == 2, placed
    assert first.master_addr == hosts[placed[0]].address
    wait_for("both ranks of attempt 1 stepping", lambda: stepping_ranks(rig, job_id, first.attempt) == {0, 1}, 240)
    alloc = json.loads((rig.layout.attempt_dir(TENANT, job_id, first.attempt)
                        / f"allocation.{placed[0]}.json").read_text())
    assert alloc["masterAddr"] == hosts[placed[0]].address

    ready = wait_for("a READY checkpoint of attempt 1",
                     lambda: rig._redis_call(lambda store: store.latest_ready_checkpoint(job_id)), 120)

    # 2. Cut rank 0's host off mid-run (its stale rank keeps running, unaware).
    victim = placed[0]
    stale = rig.rank_pids(job_id, first.attempt)
    assert set(stale) == {0, 1}, stale
    stack.net.cut(hosts[victim])
    try:
        def replaced() -> JobRecord | None:
            job = rig.job(job_id)
            return job if job is not None and job.current is not None and job.current.attempt > first.attempt \
                else None

        job = wait_for("the scheduler to end attempt 1 and place another", replaced, 90)
        old = next(a for a in job.attempts if a.attempt == first.attempt)
        assert old.state == "failed" and (old.failure_reason or "").startswith("lost"), old.failure_reason
        assert victim in (old.failure_reason or "")
        second = job.current
        assert second is not None and second.epoch > old.epoch
        moved = rank_hosts(second)
        assert victim not in moved.values() and len(set(moved.values())) == 2, moved
        assert second.master_addr == hosts[moved[0]].address != hosts[victim].address
        assert second.start_checkpoint is not None and second.start_checkpoint.global_step >= ready.global_step
        wait_for("both ranks of the new attempt stepping",
                 lambda: stepping_ranks(rig, job_id, second.attempt) == {0, 1}, 240)
        stale_alive = pid_alive(stale[0])
    finally:
        stack.net.restore(hosts[victim])

    # 3. Back on the network: the stale rank (old epoch) is stopped, and changes nothing.
    wait_for(f"the stale rank on {victim} (pid {stale[0]}) to be stopped", lambda: not pid_alive(stale[0]), 90)
    if stale_alive:
        log = agent_log(stack, victim)
        assert f"revoking allocation {old.allocation_id}" in log or f"allocation {old.allocation_id} was released" \
            in log, log[-3000:]
    wait_for(f"{victim} heart-beating again",
             lambda: next(n for n in stack.nodes() if n.node_id == victim).last_seen > nodes[victim].last_seen, 60)
    # the new attempt trains on past the stale agent's return
    step = max(rig.attempt_steps(job_id, second.attempt))
    wait_for("the new attempt to keep training",
             lambda: max(rig.attempt_steps(job_id, second.attempt)) > step + 2, 120)
    job = rig.job(job_id)
    assert job is not None and job.state not in TERMINAL_STATES
    assert job.current is not None and (job.current.attempt, job.current.epoch) == (second.attempt, second.epoch)
    assert job.current.state == "running"
    old_now = next(a for a in job.attempts if a.attempt == first.attempt)
    assert (old_now.state, old_now.failure_reason) == ("failed", old.failure_reason)
