"""Blame needs evidence: who is at fault when nodes go silent, drains, and the quarantine floor. Pure, table-driven."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from trainyard_contract.events import AllocationRevoked, CheckpointRequested
from trainyard_scheduler import health
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.blame import Silence, SilencePolicy, judge_silence
from tests.unit.trainyard_scheduler.test_transitions import (
    DEADLINES,
    POLICY,
    admitted,
    at,
    exited,
    new_job,
    running,
)

T0 = datetime(2025, 1, 1, tzinfo=UTC)
POL = SilencePolicy(node_timeout_s=15.0, cluster_share=0.5, recent_s=3600.0)
CLUSTER = ("n1", "n2", "n3", "n4")


def seen(*silent: str, now: float = 100.0, gone_for: float = 30.0) -> dict[str, datetime]:
    """Every node of CLUSTER last seen just now, the ``silent`` ones ``gone_for`` seconds ago."""
    return {n: T0 + timedelta(seconds=now - (gone_for if n in silent else 0.5)) for n in CLUSTER}


@pytest.mark.parametrize(("case", "attempt_nodes", "silent", "draining", "watching_for", "verdict"), [
    ("every node heart-beats", ("n1", "n2"), (), (), 100, "alive"),
    ("its rank's node alone went silent", ("n1", "n2"), ("n1",), (), 100, "node"),
    ("all nodes silent together (broker or network)", ("n1", "n2"), CLUSTER, (), 100, "control-plane"),
    ("most nodes silent together", ("n1", "n2"), ("n1", "n2", "n3"), (), 100, "control-plane"),
    ("half of the cluster silent together is not most of it", ("n1",), ("n1", "n2"), (), 100, "node"),
    ("the scheduler just took over (leader gap)", ("n1",), ("n1",), (), 5, "wait"),
    ("every service restarted (make up after make down)", ("n1", "n2"), CLUSTER, (), 0, "wait"),
    ("a drained node stops on purpose", ("n1", "n2"), ("n1",), ("n1",), 100, "drain"),
    ("every node drained (make down)", ("n1", "n2"), CLUSTER, CLUSTER, 100, "drain"),
    ("a drained and an undrained node silent, the rest not", ("n1", "n2"), ("n1", "n2"), ("n1",), 100, "node"),
    ("one of two nodes silent (the local stack)", ("n1",), ("n1",), (), 100, "node"),
])
def test_silence_is_blamed_on_a_node_only_when_it_points_at_it(case: str, attempt_nodes: tuple[str, ...],
                                                               silent: tuple[str, ...], draining: tuple[str, ...],
                                                               watching_for: float, verdict: str) -> None:
    now = T0 + timedelta(seconds=100)
    available = [n for n in CLUSTER if n not in silent]
    got = judge_silence(attempt_nodes, available=available, last_seen=seen(*silent), draining=draining,
                        watching_since=now - timedelta(seconds=watching_for), now=now, policy=POL)
    assert got.verdict == verdict, f"{case}: {got}"
    expected = {n for n in attempt_nodes if n in silent and (verdict != "node" or n not in draining)}
    assert set(got.nodes) == expected, f"{case}: a drained node is never blamed"


def test_nodes_not_seen_for_long_are_not_part_of_the_cluster() -> None:
    now = T0 + timedelta(seconds=10_000)
    last = {"n1": now - timedelta(seconds=30), "n2": now, "n3": now,
            "old1": now - timedelta(seconds=9000), "old2": now - timedelta(seconds=9000)}
    got = judge_silence(["n1"], available=["n2", "n3"], last_seen=last, draining=(),
                        watching_since=T0, now=now, policy=POL)
    assert got.verdict == "node" and got.detail == "node n1 stopped sending heartbeats"


# ----------------------------------------------------------------------------- reconcile with the judge

KW = {"final_ready": False, "deadlines": DEADLINES, "policy": POLICY}


@pytest.mark.parametrize(("verdict", "state", "blamed", "failed"), [
    ("node", "queued", [("n1", "lost")], 1),
    ("control-plane", "queued", [], 0),
    ("wait", "running", [], 0),
    ("drain", "running", [], 0),
])
def test_reconcile_acts_on_the_verdict(verdict: str, state: str, blamed: list, failed: int) -> None:
    job = running(admitted(new_job()))
    outcome = tr.check_attempt(job, available_nodes=frozenset(), now=at(5), latest_ready_step=10,
                               judge=lambda nodes: Silence(verdict, tuple(nodes), f"{verdict} detail"), **KW)  # type: ignore[arg-type]  # a test double
    assert outcome.job.state == state and outcome.blame == blamed and tr.failures(outcome.job) == failed
    if verdict == "control-plane":
        assert outcome.job.current.state == "revoked" and outcome.release is not None
        assert outcome.job.current.interruption == "control-plane: control-plane detail"
        assert outcome.job.queued_reason_kind == "interrupted"
        assert "not a failure" in outcome.job.queued_reason and "checkpoint at step 10" in outcome.job.queued_reason
        assert tr.is_pending(outcome.job) and tr.retry_not_before(outcome.job, POLICY) is None


# ----------------------------------------------------------------------------- drain


def drained(job, now: float = 50, ready: int | None = 10) -> tr.Outcome:
    return tr.request_drain(job, reason="node n1 drained by admin", latest_ready_step=ready, grace_s=300, now=at(now))


def test_a_drain_asks_for_a_checkpoint_then_ends_as_maintenance_not_a_failure() -> None:
    asked = drained(running(admitted(new_job())))
    assert [type(e) for e in asked.events] == [CheckpointRequested]
    assert asked.events[0].reason == "drain: node n1 drained by admin"
    job = asked.job
    assert tr.is_stopping(job) and job.current.interruption == "maintenance: node n1 drained by admin"
    assert drained(job).changed is False  # asked once
    # the ranks agree, save step 15 and exit 7; the agent stops the rest: no failure meanwhile
    one = tr.worker_exited(job, exited(job, 0, code=7, reason="preempted", step=15), latest_ready_step=10,
                           final_ready=False, policy=POLICY, now=at(60))
    two = tr.worker_exited(one.job, exited(one.job, 1, code=-15, reason="killed"), latest_ready_step=10,
                           final_ready=False, policy=POLICY, now=at(61))
    assert two.job.current.state == "running" and two.blame == [] and tr.failures(two.job) == 0
    done = tr.check_preemption(two.job, latest_ready_step=15, preemptor_waiting=False, grace_s=60, now=at(62),
                               pause_grace_s=300)
    assert done.job.state == "queued" and done.job.current.state == "revoked" and done.release is not None
    assert done.job.queued_reason_kind == "maintenance"
    assert done.job.queued_reason.startswith("attempt 1 interrupted by maintenance: node n1 drained by admin")
    assert "checkpoint at step 15" in done.job.queued_reason and tr.failures(done.job) == 0
    assert tr.is_pending(done.job) and tr.retry_not_before(done.job, POLICY) is None
    assert any(isinstance(e, AllocationRevoked) for e in done.events)


def test_a_drain_waits_for_the_ranks_own_checkpoint_not_one_in_flight() -> None:
    job = drained(running(admitted(new_job())), ready=4).job
    # the scheduled checkpoint at 10 was being written when the drain asked: not the one the ranks agree on
    assert tr.check_preemption(job, latest_ready_step=10, preemptor_waiting=False, grace_s=60, now=at(60),
                               pause_grace_s=300).changed is False
    stopping = tr.worker_exited(job, exited(job, 0, code=7, reason="preempted", step=13), latest_ready_step=10,
                                final_ready=False, policy=POLICY, now=at(61)).job
    stopping = tr.worker_exited(stopping, exited(stopping, 1, code=7, reason="preempted", step=13),
                                latest_ready_step=10, final_ready=False, policy=POLICY, now=at(61)).job
    assert tr.check_preemption(stopping, latest_ready_step=10, preemptor_waiting=False, grace_s=60, now=at(62),
                               pause_grace_s=300).changed is False
    done = tr.check_preemption(stopping, latest_ready_step=13, preemptor_waiting=False, grace_s=60, now=at(63),
                               pause_grace_s=300)
    assert done.job.state == "queued" and done.job.current.ready_step_at_end == 13


def test_a_drain_waits_for_the_checkpoint_up_to_the_pause_grace() -> None:
    job = drained(running(admitted(new_job()))).job
    early = tr.check_preemption(job, latest_ready_step=10, preemptor_waiting=False, grace_s=5, now=at(100),
                                pause_grace_s=300)
    assert early.changed is False  # the preemption grace (5 s) is not the drain's
    late = tr.check_preemption(job, latest_ready_step=10, preemptor_waiting=False, grace_s=5, now=at(351),
                               pause_grace_s=300)
    assert late.job.state == "queued" and late.job.current.interruption.startswith("maintenance")


@pytest.mark.parametrize(("setup", "events", "state"), [
    ("ranks not started", 0, "queued"),
    ("already pausing", 0, "running"),
    ("ranks stopped on their own", 0, "running"),
])
def test_a_drain_of_an_attempt_that_is_not_training(setup: str, events: int, state: str) -> None:
    job = admitted(new_job())
    if setup != "ranks not started":
        job = running(job)
    if setup == "already pausing":
        job = tr.request_control(job, "pause", None, at(10), latest_ready_step=10).job
    if setup == "ranks stopped on their own":
        job = tr.worker_exited(job, exited(job, 0, code=7, reason="preempted", step=15), latest_ready_step=10,
                               final_ready=False, policy=POLICY, now=at(20)).job
    outcome = drained(job)
    assert len(outcome.events) == (1 if setup == "ranks not started" else 0)  # the revocation
    assert outcome.job.state == state and outcome.job.current.interruption is not None
    assert tr.failures(outcome.job) == 0


def test_a_drain_of_a_pausing_job_ends_paused() -> None:
    job = tr.request_control(running(admitted(new_job())), "pause", None, at(10), latest_ready_step=10).job
    job = drained(job).job
    for rank in range(2):  # the ranks checkpoint step 15 and exit 7
        job = tr.worker_exited(job, exited(job, rank, code=7, reason="preempted", step=15), latest_ready_step=10,
                               final_ready=False, policy=POLICY, now=at(61)).job
    done = tr.check_preemption(job, latest_ready_step=15, preemptor_waiting=False, grace_s=60, now=at(62))
    assert done.job.state == "paused"


def test_a_drain_keeps_a_preemption_from_being_withdrawn() -> None:
    job = tr.request_preemption(running(admitted(new_job())), by="urgent", reason="r", latest_ready_step=10,
                                grace_s=60, now=at(10)).job
    job = drained(job).job
    kept = tr.check_preemption(job, latest_ready_step=10, preemptor_waiting=False, grace_s=60, now=at(20))
    assert kept.changed is False  # still stopping: the drain needs it to


# ----------------------------------------------------------------------------- quarantine floor

FOUR = {f"n{i}": {"h100": 8} for i in range(4)}


@pytest.mark.parametrize(("case", "capacity", "node", "out", "share", "allowed"), [
    ("one of four", FOUR, "n0", (), 0.5, True),
    ("two of four, at the limit", FOUR, "n1", ("n0",), 0.5, True),
    ("three of four, over the limit", FOUR, "n2", ("n0", "n1"), 0.5, False),
    ("one of two local nodes", {"a": {"cpu": 4}, "b": {"cpu": 4}}, "a", (), 0.5, True),
    ("the second of two local nodes", {"a": {"cpu": 4}, "b": {"cpu": 4}}, "b", ("a",), 0.5, False),
    ("the only node of its type", {"a": {"cpu": 4}}, "a", (), 1.0, False),
    ("the last node of a type, any share", {"a": {"cpu": 4}, "b": {"cpu": 4}}, "b", ("a",), 1.0, False),
    ("another type is not affected", {"a": {"cpu": 4}, "g": {"h100": 8}, "g2": {"h100": 8}}, "g", (), 0.5, True),
])
def test_automatic_quarantine_has_a_floor(case: str, capacity: dict, node: str, out: tuple[str, ...], share: float,
                                          allowed: bool) -> None:
    why = health.quarantine_floor(node, capacity=capacity, out=out, max_share=share)
    assert (why is None) == allowed, f"{case}: {why}"


# ----------------------------------------------------------------------------- saying why a job waits

NO_CPU = "capacity: needs 2 cpu devices; the cluster has no healthy cpu devices (0 available nodes; device types: none)"
UNTIL = datetime(2026, 1, 1, 12, tzinfo=UTC)


@pytest.mark.parametrize(("case", "out", "available", "kind", "says"), [
    ("nothing out of service", [], 0, "capacity", [NO_CPU]),
    ("every node quarantined", [health.OutOfService("node-0", {"cpu": 4}, "quarantined", "failure score 3.99",
                                                    "reputation", UNTIL),
                                health.OutOfService("node-1", {"cpu": 4}, "quarantined", "by hand", "alice")],
     0, "quarantine", ["quarantine: every cpu node is out of service (8 healthy cpu devices on 2 nodes)",
                       "node-0 quarantined by reputation (failure score 3.99) until 2026-01-01T12:00:00+00:00",
                       "trainyard admin nodes reinstate node-0",
                       "node-1 quarantined by alice (by hand) until an admin"]),
    ("every node drained", [health.OutOfService("node-0", {"cpu": 4}, "drained", "kernel upgrade", "alice")],
     0, "maintenance", ["maintenance: every cpu node is out of service", "trainyard admin nodes undrain node-0"]),
    ("a node agent stopping", [health.OutOfService("node-0", {"cpu": 4}, "drained", "stopping", "node-agent")],
     0, "maintenance", ["until its node agent restarts"]),
    ("some capacity left", [health.OutOfService("node-0", {"cpu": 4}, "quarantined", "s", "reputation", UNTIL)],
     4, "capacity", ["capacity: waiting", "out of service as well (4 cpu devices): node-0 quarantined"]),
    ("another type out of service", [health.OutOfService("g0", {"h100": 8}, "quarantined", "s", "reputation", UNTIL)],
     0, "capacity", [NO_CPU]),
])
def test_a_waiting_job_names_quarantined_and_drained_nodes(case: str, out: list, available: int, kind: str,
                                                           says: list[str]) -> None:
    base = NO_CPU if available == 0 else "capacity: waiting for 8 free cpu devices (4 free)"
    reason, got_kind = health.explain_wait(base, "capacity", gpu_type="cpu", available_devices=available, out=out)
    assert got_kind == kind, case
    for text in says:
        assert text in reason, f"{case}: {text!r} not in {reason!r}"
    if out and available == 0 and kind != "capacity":
        assert "no healthy" not in reason


def test_quota_and_back_off_reasons_are_left_alone() -> None:
    out = [health.OutOfService("node-0", {"cpu": 4}, "quarantined", "s", "reputation", UNTIL)]
    assert health.explain_wait("quota: tenant t holds 8", "quota", gpu_type="cpu", available_devices=0,
                               out=out) == ("quota: tenant t holds 8", "quota")


@pytest.mark.parametrize(("watched_s", "state", "failed", "blamed"), [
    (None, "queued", 1, True),  # no notion of watching: as before
    (600, "queued", 1, True),  # watched throughout: the nodes that never started ranks are blamed
    (10, "queued", 0, False),  # the platform was down meanwhile: an interruption
])
def test_a_start_timeout_across_a_control_plane_restart_is_no_ones_fault(watched_s: float | None, state: str,
                                                                        failed: int, blamed: bool) -> None:
    job = admitted(new_job())
    outcome = tr.check_attempt(job, available_nodes=frozenset({"n1"}), now=at(61), watched_s=watched_s, **KW)
    assert outcome.job.state == state and tr.failures(outcome.job) == failed
    assert bool(outcome.blame) == blamed
    if not blamed:
        assert (outcome.job.current.interruption or "").startswith("control-plane: 0 of 2 ranks started")


# ----------------------------------------------------------------------------- drains from heartbeats

ADMIN_DRAIN = {"reason": "kernel upgrade", "by": "alice", "bootId": "b1"}
AGENT_DRAIN = {"reason": "stopping", "by": "node-agent", "bootId": "b1"}


@pytest.mark.parametrize(("case", "entry", "draining", "boot", "previous", "change"), [
    ("an agent starts stopping", None, True, "b1", "b1", "start"),
    ("it keeps stopping", AGENT_DRAIN, True, "b1", "b1", "keep"),
    ("a normal heartbeat, no drain", None, False, "b1", "b1", "keep"),
    ("the stopping agent came back as a new incarnation", AGENT_DRAIN, False, "b2", "b1", "end"),
    ("an admin's drain stays while the same agent runs", ADMIN_DRAIN, False, "b1", "b1", "keep"),
    ("an admin's drain ends when the node restarts", ADMIN_DRAIN, False, "b2", "b1", "end"),
    ("an admin's drain recorded before any boot id", {**ADMIN_DRAIN, "bootId": None}, False, "b2", "b1", "end"),
    ("…and while that agent still runs", {**ADMIN_DRAIN, "bootId": None}, False, "b1", "b1", "keep"),
    ("an old agent without a boot id", {**AGENT_DRAIN, "bootId": None}, False, None, None, "end"),
    ("an admin drain, agent without a boot id", {**ADMIN_DRAIN, "bootId": None}, False, None, None, "keep"),
])
def test_a_heartbeat_starts_or_ends_a_drain(case: str, entry: dict | None, draining: bool, boot: str | None,
                                            previous: str | None, change: str) -> None:
    assert health.drain_change(entry, draining=draining, boot_id=boot, previous_boot_id=previous) == change, case


def test_a_squatted_rendezvous_port_interrupts_the_attempt_without_a_failure_or_blame() -> None:
    """Rank 0's node found the master port held (WorkerExited ``port-in-use``, no rank started): the attempt is
    interrupted — no failure budget spent, no node blamed — and the job queues for another port; it never fails
    however often a squatter does it."""
    job = admitted(new_job())
    for attempt in range(1, 6):  # more than max_attempts (3) squats in a row
        a = job.current
        assert a is not None and a.attempt == attempt
        outcome = tr.worker_exited(job, exited(job, 0, 127, "port-in-use"), final_ready=False, policy=POLICY,
                                   now=at(attempt))
        job = outcome.job
        assert job.state == "queued" and outcome.blame == [], (attempt, job.state, outcome.blame)
        assert job.attempts[-1].interruption is not None and "rendezvous port" in job.attempts[-1].interruption
        assert job.queued_reason_kind == "interrupted"
        assert any(isinstance(e, AllocationRevoked) for e in outcome.events)
        job = admitted(job, epoch=attempt + 1, now=attempt + 0.5)
    assert tr.worker_exited(job, exited(job, 0, 1, "error"), final_ready=False, policy=POLICY,
                            now=at(10)).job.state == "queued"  # an ordinary failure still counts: the first one
