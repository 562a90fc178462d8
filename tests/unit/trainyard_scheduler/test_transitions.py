"""The job/attempt state machine: pure transitions, both orders of the success conditions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from trainyard_contract.events import (
    AllocationRevoked,
    CheckpointRef,
    CheckpointRequested,
    EnvironmentPreparing,
    DeviceInfo,
    GangAllocated,
    JobStateChanged,
    SecurityViolation,
    WorkerExited,
    WorkerStarted,
)
from trainyard_contract.records import CheckpointRecord, DatasetRecord, JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.gang import GangRequest, Placement
from trainyard_scheduler.placement import place
from trainyard_scheduler.topology import ClusterSnapshot, NodeView

T0 = datetime(2025, 1, 1, tzinfo=UTC)
POLICY = tr.RetryPolicy(initial_interval_s=2.0, maximum_interval_s=10.0)
DEADLINES = tr.Deadlines(start_timeout_s=60.0, final_checkpoint_timeout_s=120.0)

SPEC = TrainingSpec.model_validate({
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "t",
    "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2},
    "checkpointPolicy": {"everySteps": 10},
    "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 2, "learningRate": 0.001,
                 "maxSteps": 20},
})


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def new_job(max_attempts: int = 3) -> JobRecord:
    return JobRecord(job_id="j1", tenant="t1", spec=SPEC, spec_hash=SPEC.spec_hash(), created_at=T0,
                     max_attempts=max_attempts)


def placement() -> Placement:
    devices = tuple(DeviceInfo(index=i, type="cpu", memory_bytes=0) for i in range(4))
    result = place(ClusterSnapshot((NodeView("n1", "127.0.0.1", devices),)), GangRequest("cpu", 2))
    assert isinstance(result, Placement)
    return result


def admitted(job: JobRecord, epoch: int = 1, now: float = 0, start: CheckpointRef | None = None) -> JobRecord:
    outcome = tr.admit(job, placement=placement(), allocation_id=f"alloc-{epoch}", epoch=epoch, master_port=29400,
                       start_checkpoint=start, now=at(now))
    assert outcome.changed
    return outcome.job


def started(job: JobRecord, rank: int) -> WorkerStarted:
    a = job.current
    assert a is not None
    return WorkerStarted(job_id=job.job_id, attempt=a.attempt, allocation_id=a.allocation_id, epoch=a.epoch,
                         node_id="n1", rank=rank, pid=100 + rank, log_uri="file:///log")


def exited(job: JobRecord, rank: int, code: int = 0, reason: str = "ok", *, epoch: int | None = None,
           step: int | None = None) -> WorkerExited:
    a = job.current
    assert a is not None
    return WorkerExited(job_id=job.job_id, attempt=a.attempt, allocation_id=a.allocation_id,
                        epoch=a.epoch if epoch is None else epoch, node_id="n1", rank=rank, exit_code=code,
                        reason=reason, global_step=step)


def running(job: JobRecord) -> JobRecord:
    for rank in range(2):
        job = tr.worker_started(job, started(job, rank), at(1)).job
    return job


def states(outcome: tr.Outcome) -> list[str]:
    return [e.state for e in outcome.events if isinstance(e, JobStateChanged)]


def test_admit_appends_an_attempt_and_publishes_gang_allocated() -> None:
    start = CheckpointRef(manifest_uri="file:///m.json", global_step=10, attempt=1)
    outcome = tr.admit(new_job(), placement=placement(), allocation_id="a1", epoch=7, master_port=29401,
                       start_checkpoint=start, now=T0)
    attempt = outcome.job.current
    assert attempt is not None and attempt.attempt == 1 and attempt.epoch == 7 and attempt.state == "starting"
    assert attempt.devices == ["n1:0", "n1:1"] and attempt.start_checkpoint == start
    (event,) = outcome.events
    assert isinstance(event, GangAllocated)
    assert (event.epoch, event.world_size, event.master_addr, event.master_port) == (7, 2, "127.0.0.1", 29401)
    assert event.start_checkpoint == start and event.spec == SPEC
    assert event.occurred_at == T0  # the decision's clock, not the wall clock
    assert outcome.job.state == "queued"  # running only once a worker reports in
    assert tr.admit(outcome.job, placement=placement(), allocation_id="a2", epoch=8, master_port=1,
                    start_checkpoint=None, now=T0).changed is False  # not pending any more


def test_first_worker_started_makes_the_job_running_once() -> None:
    job = admitted(new_job())
    first = tr.worker_started(job, started(job, 0), at(1))
    assert first.job.state == "running" and first.job.current.state == "running"
    assert states(first) == ["running"]
    second = tr.worker_started(first.job, started(first.job, 1), at(1))
    assert second.events == [] and second.job.current.started_ranks == [0, 1]
    assert tr.worker_started(second.job, started(second.job, 1), at(2)).changed is False  # duplicate


@pytest.mark.parametrize("checkpoint_first", [True, False], ids=["checkpoint-then-exits", "exits-then-checkpoint"])
def test_success_needs_every_rank_ok_and_the_final_checkpoint(checkpoint_first: bool) -> None:
    job = running(admitted(new_job()))
    if checkpoint_first:
        early = tr.checkpoint_ready(job, global_step=20, now=at(5))
        assert early.changed is False  # ranks still running
    ready = checkpoint_first
    half = tr.worker_exited(job, exited(job, 0), final_ready=ready, policy=POLICY, now=at(6))
    assert half.job.state == "running" and half.release is None
    done = tr.worker_exited(half.job, exited(half.job, 1), final_ready=ready, policy=POLICY, now=at(7))
    assert done.job.current.state == "succeeded"
    assert done.release is not None and done.release.allocation_id == "alloc-1"  # devices freed either way
    if checkpoint_first:
        assert done.job.state == "succeeded" and states(done) == ["succeeded"]
        return
    assert done.job.state == "running" and states(done) == []
    assert tr.checkpoint_ready(done.job, global_step=10, now=at(8)).changed is False  # not the final step
    final = tr.checkpoint_ready(done.job, global_step=20, now=at(8))
    assert final.job.state == "succeeded" and states(final) == ["succeeded"]


def test_a_failed_rank_revokes_and_requeues_with_back_off() -> None:
    job = running(admitted(new_job()))
    outcome = tr.worker_exited(job, exited(job, 1, code=1, reason="error"), final_ready=False, policy=POLICY,
                               now=at(10))
    assert outcome.job.state == "queued" and states(outcome) == ["queued"]
    assert outcome.job.current.state == "failed"
    assert "rank 1 on n1 exited with code 1" in outcome.job.current.failure_reason
    revoked = [e for e in outcome.events if isinstance(e, AllocationRevoked)]
    assert len(revoked) == 1 and revoked[0].epoch == 1 and revoked[0].allocation_id == "alloc-1"
    assert outcome.release is not None
    assert tr.is_pending(outcome.job)
    assert tr.retry_not_before(outcome.job, POLICY) == at(12)
    assert {e.occurred_at for e in outcome.events} == {at(10)}  # every event stamped with the caller's now
    assert "attempt 2 resumes from the latest READY checkpoint" in outcome.job.queued_reason
    # the other rank, killed by the revocation, changes nothing
    late = tr.worker_exited(outcome.job, exited(job, 0, code=-15, reason="revoked"), final_ready=False,
                            policy=POLICY, now=at(11))
    assert late.events == [] and late.job.state == "queued"


def test_back_off_doubles_and_the_budget_ends_in_failure() -> None:
    job = new_job(max_attempts=2)
    for attempt, (epoch, expect_state) in enumerate([(1, "queued"), (2, "failed")], start=1):
        job = running(admitted(job, epoch=epoch, now=attempt * 100))
        outcome = tr.worker_exited(job, exited(job, 0, code=-9, reason="killed"), final_ready=False,
                                   policy=POLICY, now=at(attempt * 100 + 50))
        job = outcome.job
        assert job.state == expect_state
    assert job.reason.startswith("killed: rank 0 on n1 exited with code -9 (attempt 2, 2 of 2 failed in a row")
    assert not tr.is_pending(job)


@pytest.mark.parametrize(("reason", "code"), [("config", 2), ("data", 5), ("checkpoint", 4)])
def test_spec_errors_fail_at_once(reason: str, code: int) -> None:
    job = running(admitted(new_job()))
    outcome = tr.worker_exited(job, exited(job, 0, code=code, reason=reason), final_ready=False, policy=POLICY,
                               now=at(5))
    assert outcome.job.state == "failed" and states(outcome) == ["failed"]
    assert outcome.job.reason.startswith(f"{reason}:") and "not retryable" in outcome.job.reason
    assert outcome.release is not None


def test_stale_epoch_and_stale_attempt_events_are_ignored() -> None:
    job = running(admitted(new_job(), epoch=3))
    assert tr.worker_exited(job, exited(job, 0, code=1, reason="error", epoch=2), final_ready=False,
                            policy=POLICY, now=at(5)).changed is False
    stale_start = started(job, 0).model_copy(update={"allocation_id": "other"})
    assert tr.worker_started(job, stale_start, at(5)).changed is False


def test_duplicate_exit_is_a_no_op() -> None:
    job = running(admitted(new_job()))
    once = tr.worker_exited(job, exited(job, 0), final_ready=False, policy=POLICY, now=at(5)).job
    assert tr.worker_exited(once, exited(once, 0), final_ready=False, policy=POLICY, now=at(6)).changed is False


@pytest.mark.parametrize(("setup", "action", "state", "revokes"), [
    ("queued", "cancel", "cancelled", False),
    ("starting", "cancel", "cancelled", True),
    ("running", "cancel", "cancelled", True),
    ("starting", "pause", "paused", True),  # no rank runs yet: nothing to checkpoint, paused at once
    ("queued", "pause", "paused", False),
])
def test_control(setup: str, action: str, state: str, revokes: bool) -> None:
    job = new_job()
    if setup != "queued":
        job = admitted(job)
    if setup == "running":
        job = running(job)
    outcome = tr.request_control(job, action, None, at(5))
    assert outcome.job.state == state and states(outcome) == [state]
    assert bool([e for e in outcome.events if isinstance(e, AllocationRevoked)]) is revokes
    assert (outcome.release is not None) is revokes
    if action == "cancel":
        assert outcome.job.reason == "cancelled by request"


def stop7(job: JobRecord, rank: int, step: int | None, *, ready: int | None, now: float) -> tr.Outcome:
    """Rank ``rank`` checkpointed ``step`` on request and exited 7 (what the SDK does)."""
    return tr.worker_exited(job, exited(job, rank, code=7, reason="preempted", step=step), final_ready=False,
                            policy=POLICY, now=at(now), latest_ready_step=ready)


def test_pause_then_resume_requeues_without_spending_an_attempt() -> None:
    job = running(admitted(new_job()))
    asked = tr.request_control(job, "pause", None, at(5), latest_ready_step=None, grace_s=30)
    job = stop7(asked.job, 0, 12, ready=None, now=6).job
    job = stop7(job, 1, 12, ready=None, now=6).job
    paused = tr.check_preemption(job, latest_ready_step=12, preemptor_waiting=False, grace_s=60,
                                 now=at(8), pause_grace_s=30).job
    assert paused.state == "paused" and paused.current.state == "revoked" and tr.failures(paused) == 0
    assert tr.request_control(paused, "pause", None, at(6)).changed is False
    resumed = tr.request_control(paused, "resume", None, at(7))
    assert resumed.job.state == "queued" and states(resumed) == ["queued"]
    assert tr.is_pending(resumed.job) and tr.retry_not_before(resumed.job, POLICY) is None
    again = admitted(resumed.job, epoch=2)
    assert again.current.attempt == 2


def test_pause_of_running_ranks_asks_for_a_checkpoint_first() -> None:
    job = running(admitted(new_job()))
    outcome = tr.request_control(job, "pause", None, at(5), latest_ready_step=10, grace_s=30)
    (event,) = outcome.events
    assert isinstance(event, CheckpointRequested)
    assert (event.reason, event.requested_by, event.deadline) == ("pause requested", None, at(35))
    assert outcome.job.state == "running" and outcome.job.control == "pause" and outcome.release is None
    assert (outcome.job.current.preempt_after_step, outcome.job.current.state) == (10, "running")
    assert tr.request_control(outcome.job, "pause", None, at(6)).changed is False  # asked once
    assert tr.is_stopping(outcome.job)


# ----------------------------------------------------------------------------- the stop rule (pause, drain, preemption)

# The request comes at t=5 with the checkpoint at step 10 READY and the scheduled save of step 20 being written and
# assembled (in flight); the ranks are at step 24 and agree on step 25 after they see the request.
STOPS = {
    "pause": lambda job: tr.request_control(job, "pause", None, at(5), latest_ready_step=10, grace_s=30),
    "drain": lambda job: tr.request_drain(job, reason="node n1 drained", latest_ready_step=10, grace_s=30, now=at(5)),
    "preempt": lambda job: tr.request_preemption(job, by="urgent", reason="preempted for urgent", latest_ready_step=10,
                                                 grace_s=30, now=at(5)),
}
ENDS_AS = {"pause": "paused", "drain": "queued", "preempt": "queued"}


LONG = SPEC.model_copy(update={"training": SPEC.training.model_copy(update={"max_steps": 100})})


def stopping(kind: str, spec: TrainingSpec = LONG) -> JobRecord:
    """A running job (maxSteps 100 unless ``spec`` says otherwise) asked to stop at t=5 by ``kind``."""
    job = JobRecord(job_id="j1", tenant="t1", spec=spec, spec_hash=spec.spec_hash(), created_at=T0)
    outcome = STOPS[kind](running(admitted(job)))
    assert any(isinstance(e, CheckpointRequested) for e in outcome.events)
    return outcome.job


@pytest.mark.parametrize("kind", sorted(STOPS))
@pytest.mark.parametrize(("exits", "ready", "now", "ends_with"), [
    # the checkpoint READY at the request is never the stop checkpoint
    ([], 10, 20, None),
    # the scheduled save in flight at the request turns READY: not the stop checkpoint (the ranks are past it)
    ([], 20, 20, None),
    # ... not even once the ranks have said where they stopped
    ([25, 25], 20, 20, None),
    # the ranks' own checkpoint, READY, but a rank has not exited yet: it exits 7 by itself, nobody SIGTERMs it
    ([25], 25, 20, None),
    # the ranks' own checkpoint READY and every rank exited 7: the stop ends with it
    ([25, 25], 25, 20, "its ranks stopped and the checkpoint at step 25 is READY"),
    # the rank a stop is torn down with (the agent's kill) counts as exited
    ([25, "killed"], 25, 20, "its ranks stopped and the checkpoint at step 25 is READY"),
    # the grace is over: revoked anyway (the agent stops what still runs), resumes from the last READY one
    ([], 20, 36, "no checkpoint of its ranks READY within 30s; it resumes from the last READY one"),
])
def test_a_stop_ends_only_with_the_checkpoint_the_ranks_agreed_on_after_the_request(
        kind: str, exits: list, ready: int, now: float, ends_with: str | None) -> None:
    job = stopping(kind)
    for rank, how in enumerate(exits):
        event = (exited(job, rank, code=7, reason="preempted", step=how) if isinstance(how, int)
                 else exited(job, rank, code=-15, reason=how))
        job = tr.worker_exited(job, event, final_ready=False, policy=POLICY, now=at(6), latest_ready_step=10).job
        assert job.current.state == "running"  # no exit ends it before its checkpoint is READY
    outcome = tr.check_preemption(job, latest_ready_step=ready, preemptor_waiting=True, grace_s=30, now=at(now),
                                  pause_grace_s=30)
    assert outcome.changed is (ends_with is not None)
    if ends_with is None:
        assert outcome.release is None and tr.stop_checkpoint(job.current, ready) is None
        return
    assert outcome.job.state == ENDS_AS[kind] and outcome.job.current.state == "revoked"
    assert tr.failures(outcome.job) == 0
    assert ends_with in f"{outcome.job.current.failure_reason} {outcome.note}"
    assert outcome.release is not None and outcome.job.current.ready_step_at_end == ready
    if kind == "pause":
        assert outcome.job.control is None and not tr.is_pending(outcome.job)  # nothing placed until resume


@pytest.mark.parametrize(("stopped", "exited_ranks", "after", "ready", "stop_step"), [
    (False, {}, 10, 20, None),  # no rank reported: none counts, whatever is READY
    (True, {"0": 7}, 24, 25, None),  # one of two ranks exited
    (True, {"0": 7, "1": 7}, 24, 20, None),  # every rank exited at 25; 20 is older
    (True, {"0": 7, "1": 7}, 24, 25, 25),
    (True, {"0": 7, "1": 7}, 24, 30, 30),  # a later one (a save the stop was waiting behind) covers it
    (True, {"0": 7, "1": 7}, 24, None, None),
])
def test_stop_checkpoint(stopped: bool, exited_ranks: dict[str, int], after: int, ready: int | None,
                         stop_step: int | None) -> None:
    attempt = stopping("pause").current.model_copy(update={
        "ranks_stopped_at": at(6) if stopped else None, "exited_ranks": exited_ranks, "preempt_after_step": after})
    assert tr.stop_checkpoint(attempt, ready) == stop_step


@pytest.mark.parametrize("kind", sorted(STOPS))
@pytest.mark.parametrize("ready_first", [True, False], ids=["final-ready-then-exits", "exits-then-final-ready"])
def test_a_stop_that_reaches_the_ranks_at_the_last_step_completes_the_job(kind: str, ready_first: bool) -> None:
    """Ranks asked at maxSteps save it and exit 0 (nothing is left to stop): the job succeeds, never paused."""
    job = stopping(kind, SPEC)
    if ready_first:  # the scheduler's CheckpointReady handler: checkpoint_ready, then the stop in progress
        early = tr.checkpoint_ready(job, global_step=20, now=at(6))
        assert early.changed is False
        assert tr.check_preemption(job, latest_ready_step=20, preemptor_waiting=True, grace_s=30, now=at(6),
                                   pause_grace_s=30).changed is False
    for rank in range(2):
        job = tr.worker_exited(job, exited(job, rank, step=20), final_ready=ready_first, policy=POLICY, now=at(7),
                               latest_ready_step=20 if ready_first else 10).job
    if not ready_first:
        assert job.state == "running" and job.current.state == "succeeded"
        job = tr.checkpoint_ready(job, global_step=20, now=at(8)).job
    assert job.state == "succeeded" and job.control is None and len(job.attempts) == 1


@pytest.mark.parametrize("kind", sorted(STOPS))
def test_a_stop_whose_grace_ends_with_the_final_checkpoint_ready_completes_the_job(kind: str) -> None:
    outcome = tr.check_preemption(stopping(kind, SPEC), latest_ready_step=20, preemptor_waiting=True, grace_s=30,
                                  now=at(36), pause_grace_s=30)
    assert outcome.job.state == "succeeded" and states(outcome) == ["succeeded"] and outcome.job.control is None
    assert outcome.release is not None and outcome.job.current.state == "revoked" and tr.failures(outcome.job) == 0


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pause_or_resume_of_a_job_whose_final_checkpoint_is_ready_completes_it(action: str) -> None:
    """A job paused at maxSteps (or queued there) is completed, not started again only to finish."""
    job = running(admitted(new_job()))
    job = tr.request_control(job, "pause", None, at(5), latest_ready_step=10, grace_s=30).job
    job = tr.check_preemption(job, latest_ready_step=20, preemptor_waiting=False, grace_s=30, now=at(2000),
                              pause_grace_s=30).job  # (a record from before: paused with maxSteps READY)
    job = job.model_copy(update={"state": "paused" if action == "resume" else "queued"})
    outcome = tr.request_control(job, action, None, at(40), latest_ready_step=20, final_ready=True)
    assert outcome.job.state == "succeeded" and states(outcome) == ["succeeded"]
    assert not tr.is_pending(outcome.job) and len(outcome.job.attempts) == 1
    assert tr.request_control(job, action, None, at(40), latest_ready_step=10).job.state != "succeeded"


def test_a_pause_after_every_rank_exited_0_waits_for_the_final_checkpoint() -> None:
    job = running(admitted(new_job()))
    for rank in range(2):
        job = tr.worker_exited(job, exited(job, rank, step=20), final_ready=False, policy=POLICY, now=at(7)).job
    outcome = tr.request_control(job, "pause", None, at(8), latest_ready_step=10)
    assert outcome.events == [] and outcome.job.state == "running" and outcome.job.control == "pause"
    done = tr.checkpoint_ready(outcome.job, global_step=20, now=at(9))
    assert done.job.state == "succeeded" and done.job.control is None
    # if that checkpoint fails after all, the pause is honoured: paused, not retried
    failed = tr.checkpoint_failed(outcome.job, global_step=20, reason="shard 1 missing", attempt=1, policy=POLICY,
                                  now=at(9))
    assert failed.job.state == "paused"


def test_ranks_that_stop_for_a_pause_wait_for_their_checkpoint_to_be_ready() -> None:
    job = tr.request_control(running(admitted(new_job())), "pause", None, at(5), latest_ready_step=10,
                             grace_s=30).job
    first = tr.worker_exited(job, exited(job, 0, code=7, reason="preempted", step=14), final_ready=False,
                             policy=POLICY, now=at(9), latest_ready_step=10)
    assert first.changed and first.release is None and first.job.state == "running"
    assert first.job.current.state == "running" and first.job.current.ranks_stopped_at == at(9)
    assert first.job.current.preempt_after_step == 13  # wait for the checkpoint at step 14, not an older one
    # A READY checkpoint newer than the request but older than the one the ranks wrote is not enough.
    assert tr.check_preemption(first.job, latest_ready_step=12, preemptor_waiting=False, grace_s=60,
                               now=at(10), pause_grace_s=30).changed is False
    second = tr.worker_exited(first.job, exited(first.job, 1, code=7, reason="preempted", step=14),
                              final_ready=False, policy=POLICY, now=at(10), latest_ready_step=14)
    assert second.job.state == "paused" and second.job.current.state == "revoked" and tr.failures(second.job) == 0
    assert second.release is not None and states(second) == ["paused"]


def test_resume_withdraws_a_pause_in_progress_and_cancel_stops_at_once() -> None:
    job = tr.request_control(running(admitted(new_job())), "pause", None, at(5), grace_s=30).job
    resumed = tr.request_control(job, "resume", None, at(6))
    assert resumed.changed and resumed.job.control is None and resumed.job.state == "running"
    assert not tr.is_stopping(resumed.job)
    cancelled = tr.request_control(job, "cancel", "enough", at(6))
    assert cancelled.job.state == "cancelled" and cancelled.job.control is None
    assert cancelled.release is not None and cancelled.job.current.state == "revoked"


def test_a_failure_while_pausing_pauses_instead_of_requeueing() -> None:
    job = tr.request_control(running(admitted(new_job())), "pause", None, at(5), grace_s=30).job
    outcome = tr.worker_exited(job, exited(job, 1, code=1, reason="error"), final_ready=False, policy=POLICY,
                               now=at(8))
    assert outcome.job.state == "paused" and outcome.job.current.state == "failed" and outcome.release is not None
    assert outcome.job.control is None and tr.failures(outcome.job) == 1


def test_control_of_a_terminal_job_is_ignored() -> None:
    job = tr.request_control(new_job(), "cancel", "user", at(1)).job
    assert job.reason == "user"
    for action in ("cancel", "pause", "resume"):
        assert tr.request_control(job, action, None, at(2)).changed is False


def test_waiting_reason_is_written_once() -> None:
    first = tr.note_waiting(new_job(), "waiting for 2 free cpu devices (0 free)")
    assert first.changed and first.job.queued_reason.startswith("waiting for 2")
    assert tr.note_waiting(first.job, "waiting for 2 free cpu devices (0 free)").changed is False


def test_reconcile_fails_attempts_on_lost_nodes_and_start_timeouts() -> None:
    job = admitted(new_job())
    kw = {"final_ready": False, "deadlines": DEADLINES, "policy": POLICY}
    assert tr.check_attempt(job, available_nodes=frozenset({"n1"}), now=at(30), **kw).changed is False
    timeout = tr.check_attempt(job, available_nodes=frozenset({"n1"}), now=at(61), **kw)
    assert timeout.job.current.failure_reason.startswith("start-timeout: 0 of 2 ranks started")
    assert timeout.job.state == "queued" and timeout.release is not None
    lost = tr.check_attempt(running(job), available_nodes=frozenset(), now=at(5), **kw)
    assert lost.job.current.failure_reason == "lost: node n1 stopped sending heartbeats"


def test_reconcile_completes_or_retries_an_attempt_waiting_for_its_final_checkpoint() -> None:
    job = running(admitted(new_job()))
    for rank in range(2):
        job = tr.worker_exited(job, exited(job, rank), final_ready=False, policy=POLICY, now=at(10)).job
    kw = {"available_nodes": frozenset({"n1"}), "deadlines": DEADLINES, "policy": POLICY}
    assert tr.check_attempt(job, final_ready=False, now=at(60), **kw).changed is False
    found = tr.check_attempt(job, final_ready=True, now=at(60), **kw)  # CheckpointReady was lost
    assert found.job.state == "succeeded"
    missing = tr.check_attempt(job, final_ready=False, now=at(131), **kw)
    assert missing.job.state == "queued" and missing.job.current.failure_reason.startswith("checkpoint-missing")
    assert missing.release is None  # its leases went when the ranks exited


def test_a_failed_final_checkpoint_retries_a_completed_attempt() -> None:
    job = running(admitted(new_job()))
    early = tr.checkpoint_failed(job, global_step=20, reason="shard 1 missing", policy=POLICY, now=at(5))
    assert early.changed is False  # the attempt still runs
    for rank in range(2):
        job = tr.worker_exited(job, exited(job, rank), final_ready=False, policy=POLICY, now=at(10)).job
    assert tr.checkpoint_failed(job, global_step=10, reason="x", policy=POLICY, now=at(11)).changed is False
    stale = tr.checkpoint_failed(job, global_step=20, reason="fenced", attempt=job.current.attempt - 1,
                                 policy=POLICY, now=at(11))
    assert stale.changed is False  # a late failure of an earlier attempt's final checkpoint: not this one's
    outcome = tr.checkpoint_failed(job, global_step=20, reason="shard 1 missing", attempt=job.current.attempt,
                                   policy=POLICY, now=at(11))
    assert outcome.job.state == "queued" and tr.is_pending(outcome.job)
    assert "the checkpoint at step 20 failed: shard 1 missing" in outcome.job.current.failure_reason


def test_reconcile_times_out_a_gang_that_only_partly_started() -> None:
    job = admitted(new_job())
    job = tr.worker_started(job, started(job, 0), at(1)).job
    kw = {"available_nodes": frozenset({"n1"}), "final_ready": False, "deadlines": DEADLINES, "policy": POLICY}
    outcome = tr.check_attempt(job, now=at(61), **kw)
    assert outcome.job.current.failure_reason.startswith("start-timeout: 1 of 2 ranks started")
    assert tr.check_attempt(running(admitted(new_job())), now=at(61), **kw).changed is False


def environment(job: JobRecord, state: str, *, node: str = "n1", epoch: int | None = None) -> EnvironmentPreparing:
    a = job.current
    assert a is not None
    return EnvironmentPreparing(job_id=job.job_id, attempt=a.attempt, allocation_id=a.allocation_id,
                                epoch=a.epoch if epoch is None else epoch, node_id=node,
                                environment="sha256:" + "e" * 64, state=state, packages=2,  # type: ignore[arg-type]  # a literal, as tests name it
                                detail="Prepared 2 packages" if state == "building" else None)


def test_a_node_building_the_environment_shows_on_the_attempt_and_holds_off_the_start_timeout() -> None:
    job = admitted(new_job())
    kw = {"available_nodes": frozenset({"n1"}), "final_ready": False, "deadlines": DEADLINES, "policy": POLICY}
    for second in (20, 50, 80, 110):  # a long build, reporting as it goes
        job = tr.environment_noted(job, environment(job, "building"), at(second)).job
        assert tr.check_attempt(job, now=at(second + 59), **kw).changed is False
    noted = job.current.environment["n1"]
    assert (noted.state, noted.packages, noted.detail) == ("building", 2, "Prepared 2 packages")
    job = tr.environment_noted(job, environment(job, "ready"), at(120)).job
    assert job.current.environment["n1"].state == "ready" and job.state == "queued"
    assert tr.check_attempt(job, now=at(170), **kw).changed is False
    timeout = tr.check_attempt(job, now=at(181), **kw)  # ready, and no rank started a start time-out later
    assert timeout.job.current.failure_reason.startswith("start-timeout: 0 of 2 ranks started")


def test_how_ranks_started_is_counted_on_the_attempt() -> None:
    job = admitted(new_job())
    cold = started(job, 0).model_copy(update={"start": "cold", "start_detail": "user code starts in a new interpreter"})
    job = tr.worker_started(job, cold, at(1)).job
    job = tr.worker_started(job, started(job, 1).model_copy(update={"start": "warm"}), at(1)).job
    job = tr.worker_started(job, cold, at(2)).job  # a duplicate counts once
    assert job.current.starts == {"cold": 1, "warm": 1}
    assert job.current.start_detail == "user code starts in a new interpreter"


def test_a_gangs_ranks_started_together_are_one_write_equal_to_one_at_a_time() -> None:
    job = admitted(new_job())
    forged = started(job, 1).model_copy(update={"epoch": 0, "rank": 0})  # a stale epoch: changes nothing
    batch = [forged, started(job, 1).model_copy(update={"start": "warm"}), started(job, 0), started(job, 1)]
    together = tr.workers_started(job, batch, at(1))
    one_by_one = job
    for event in batch:
        one_by_one = tr.worker_started(one_by_one, event, at(1)).job
    assert together.changed and together.job == one_by_one
    assert together.job.current.started_ranks == [0, 1] and together.job.current.starts == {"warm": 1}
    assert states(together) == ["running"]  # queued → running once
    assert tr.workers_started(together.job, batch, at(2)).changed is False  # the batch redelivered
    assert tr.workers_started(job, [forged], at(1)).changed is False


def test_a_worker_batch_is_written_in_each_jobs_order_with_a_run_of_starts_as_one_write() -> None:
    a, b = admitted(new_job()), admitted(new_job()).model_copy(update={"job_id": "j2"})
    a0, a1, b0, b1 = started(a, 0), started(a, 1), started(b, 0), started(b, 1)
    a_exit, a_again = exited(a, 0, 1, "error"), started(a, 1)
    runs = tr.worker_runs([a0, b0, a1, b1, a_exit, a_again])
    assert runs == [[a0, a1], [a_exit], [a_again], [b0, b1]]
    assert tr.worker_runs([]) == []


def test_environment_progress_of_a_stale_attempt_or_after_its_end_changes_nothing() -> None:
    job = admitted(new_job())
    assert tr.environment_noted(job, environment(job, "building", epoch=0), at(1)).changed is False
    ready = tr.environment_noted(job, environment(job, "ready"), at(2)).job
    late = tr.environment_noted(ready, environment(ready, "building"), at(3))  # redelivered from before
    assert late.changed is False and late.job.current.environment["n1"].state == "ready"


# ----------------------------------------------------------------------------- preemption


def preempted(job: JobRecord, *, ready_step: int | None = 10, now: float = 100) -> tr.Outcome:
    return tr.request_preemption(job, by="urgent", reason="preempted for urgent (lower priority)",
                                 latest_ready_step=ready_step, grace_s=60, now=at(now))


def test_admit_records_the_placement_detail() -> None:
    job = admitted(new_job())
    assert job.current.placement_detail is not None and job.current.placement_detail.nodes == 1


def test_preemption_asks_for_a_checkpoint_first() -> None:
    job = running(admitted(new_job()))
    outcome = preempted(job)
    (event,) = outcome.events
    assert isinstance(event, CheckpointRequested)
    assert (event.requested_by, event.epoch, event.deadline) == ("urgent", 1, at(160))
    current = outcome.job.current
    assert (current.preempted_by, current.preempt_after_step, current.state) == ("urgent", 10, "running")
    assert outcome.release is None and outcome.job.state == "running"
    assert preempted(outcome.job).changed is False  # asked once
    assert tr.request_preemption(new_job(), by="x", reason="r", latest_ready_step=None, grace_s=1,
                                 now=T0).changed is False  # nothing live


def test_preemption_is_withdrawn_when_the_preemptor_no_longer_waits() -> None:
    job = preempted(running(admitted(new_job()))).job
    outcome = tr.check_preemption(job, latest_ready_step=10, preemptor_waiting=False, grace_s=60, now=at(500))
    assert outcome.changed and outcome.events == [] and outcome.release is None
    assert outcome.job.current.preempted_by is None and outcome.job.current.state == "running"


def test_waiting_reason_carries_its_kind() -> None:
    first = tr.note_waiting(new_job(), "quota: tenant t1 holds 8", "quota")
    assert (first.job.queued_reason_kind, first.changed) == ("quota", True)
    assert tr.note_waiting(first.job, "quota: tenant t1 holds 8", "quota").changed is False
    assert tr.note_waiting(first.job, "quota: tenant t1 holds 8", "capacity").changed is True


def test_ranks_that_answer_the_checkpoint_request_end_the_attempt_once_it_is_ready() -> None:
    job = preempted(running(admitted(new_job()))).job
    outcome = tr.worker_exited(job, exited(job, 0, code=7, reason="preempted", step=15), final_ready=False,
                               policy=POLICY, now=at(130), latest_ready_step=10)
    assert outcome.job.state == "running" and outcome.job.current.state == "running" and outcome.release is None
    # the rest of the gang is torn down by its agent: still no failure while the stop completes
    torn = tr.worker_exited(outcome.job, exited(outcome.job, 1, code=-15, reason="killed"), final_ready=False,
                            policy=POLICY, now=at(131), latest_ready_step=10)
    assert torn.job.current.state == "running" and tr.failures(torn.job) == 0
    done = tr.check_preemption(torn.job, latest_ready_step=15, preemptor_waiting=True, grace_s=60, now=at(132))
    assert done.job.state == "queued" and done.job.current.state == "revoked"
    assert done.job.current.failure_reason == \
        "preempted by urgent: its ranks stopped and the checkpoint at step 15 is READY"
    assert tr.failures(done.job) == 0 and done.release is not None
    # the preemptor stopped waiting meanwhile: ranks that already stopped cannot be withdrawn
    late = tr.check_preemption(torn.job, latest_ready_step=10, preemptor_waiting=False, grace_s=60, now=at(200))
    assert late.job.state == "queued" and "READY within 60s" in (late.job.current.failure_reason or "")


def test_ranks_that_stop_unasked_end_as_a_stop_not_a_failure() -> None:
    plain = running(admitted(new_job()))
    waiting = tr.worker_exited(plain, exited(plain, 0, code=7, reason="preempted", step=8), final_ready=False,
                               policy=POLICY, now=at(5), latest_ready_step=None)
    assert waiting.job.current.state == "running" and waiting.release is None
    ended = tr.worker_exited(waiting.job, exited(waiting.job, 1, code=7, reason="preempted", step=8),
                             final_ready=False, policy=POLICY, now=at(6), latest_ready_step=8)
    assert ended.job.state == "queued" and ended.job.current.state == "revoked" and tr.failures(ended.job) == 0
    assert ended.job.queued_reason_kind == "preemption"
    # without a step, there is nothing to wait for but every rank's own exit
    quick = tr.worker_exited(plain, exited(plain, 0, code=7, reason="preempted"), final_ready=False,
                             policy=POLICY, now=at(5))
    assert quick.job.state == "running" and quick.release is None
    quick = tr.worker_exited(quick.job, exited(quick.job, 1, code=7, reason="preempted"), final_ready=False,
                             policy=POLICY, now=at(5))
    assert quick.job.state == "queued" and quick.release is not None


# ----------------------------------------------------------------------------- retry policy


def fail(job: JobRecord, *, at_s: float, reason: str = "error", code: int = 1, step: int | None = None,
         ready: int | None = None, policy: tr.RetryPolicy = POLICY) -> tr.Outcome:
    return tr.worker_exited(job, exited(job, 0, code=code, reason=reason, step=step), final_ready=False,
                            policy=policy, now=at(at_s), latest_ready_step=ready)


def checkpoint(step: int, attempt: int = 1) -> CheckpointRef:
    return CheckpointRef(manifest_uri=f"file:///c/{step}", global_step=step, attempt=attempt)


def test_nan_retries_once_per_step_and_fails_when_it_repeats_at_the_same_step() -> None:
    job = running(admitted(new_job(max_attempts=5)))
    first = fail(job, at_s=5, reason="nan", code=3, step=42, ready=40)
    assert first.job.state == "queued" and first.job.current.nan_step == 42
    assert "first time" in (first.job.current.failure_reason or "")
    second = running(admitted(first.job, epoch=2, now=10, start=checkpoint(40)))
    elsewhere = fail(second, at_s=15, reason="nan", code=3, step=47, ready=40)
    assert elsewhere.job.state == "queued"  # a NaN at another step is retried too
    third = running(admitted(elsewhere.job, epoch=3, now=20, start=checkpoint(40)))
    again = fail(third, at_s=25, reason="nan", code=3, step=42, ready=40)
    assert again.job.state == "failed" and "as in an earlier attempt" in (again.job.reason or "")
    assert "not retryable" in (again.job.reason or "")


def test_nan_at_an_unknown_step_is_retried_once() -> None:
    job = running(admitted(new_job(max_attempts=5)))
    first = fail(job, at_s=5, reason="nan", code=3)
    assert first.job.state == "queued"
    second = fail(running(admitted(first.job, epoch=2, now=10)), at_s=15, reason="nan", code=3)
    assert second.job.state == "failed"


def test_progress_resets_the_back_off_and_the_budget() -> None:
    """A long job failing every few hours but checkpointing in between never runs out of attempts."""
    job = new_job(max_attempts=2)
    ready = -1
    for n in range(1, 8):
        start = checkpoint(ready) if ready >= 0 else None
        job = running(admitted(job, epoch=n, now=n * 10_000, start=start))
        ready += 100  # this attempt wrote a newer READY checkpoint before it failed
        outcome = fail(job, at_s=n * 10_000 + 9_000, ready=ready)
        job = outcome.job
        assert job.state == "queued" and tr.failures_since_progress(job) == 1
        assert tr.retry_not_before(job, POLICY) == at(n * 10_000 + 9_000 + 2.0)  # base back-off every time
    assert tr.failures(job) == 7


def test_failures_without_progress_double_the_back_off_and_spend_the_budget() -> None:
    job = new_job(max_attempts=3)
    job = fail(running(admitted(job, epoch=1, now=0)), at_s=10, ready=50).job  # progress: 50 > nothing
    assert tr.failures_since_progress(job) == 1
    job = fail(running(admitted(job, epoch=2, now=20, start=checkpoint(50))), at_s=30, ready=50).job
    assert tr.failures_since_progress(job) == 2 and tr.retry_not_before(job, POLICY) == at(34)
    job = fail(running(admitted(job, epoch=3, now=40, start=checkpoint(50))), at_s=50, ready=50).job
    assert job.state == "failed" and "3 of 3 failed in a row without a new READY checkpoint" in (job.reason or "")


def test_an_optional_total_cap_ends_even_a_progressing_job() -> None:
    capped = tr.RetryPolicy(initial_interval_s=1, maximum_interval_s=1, maximum_attempts=2)
    job = fail(running(admitted(new_job(), epoch=1)), at_s=10, ready=10, policy=capped).job
    assert job.state == "queued"
    job = fail(running(admitted(job, epoch=2, now=20, start=checkpoint(10))), at_s=30, ready=20, policy=capped).job
    assert job.state == "failed" and "the cap is 2" in (job.reason or "")


def test_a_failure_blames_the_node_of_the_failing_rank_only() -> None:
    job = running(admitted(new_job()))
    outcome = fail(job, at_s=5, reason="nccl", code=1)
    assert outcome.blame == [("n1", "nccl")] and outcome.job.state == "queued"
    # the gang's other ranks, torn down afterwards, blame nobody
    rest = tr.worker_exited(outcome.job, exited(job, 1, code=-15, reason="revoked"), final_ready=False,
                            policy=POLICY, now=at(6))
    assert rest.blame == []
    lost = tr.check_attempt(job, available_nodes=frozenset(), final_ready=False, deadlines=DEADLINES,
                            policy=POLICY, now=at(5))
    assert lost.blame == [("n1", "lost")]


# ----------------------------------------------------------------------------- lost GangAllocated


def test_a_gang_whose_ranks_never_started_is_published_again_a_few_times() -> None:
    deadlines = tr.Deadlines(start_timeout_s=120, final_checkpoint_timeout_s=120, republish_after_s=15,
                             republish_max=2)
    job = admitted(new_job())
    available = frozenset({"n1"})

    def check(j: JobRecord, t: float) -> tr.Outcome:
        return tr.check_attempt(j, available_nodes=available, final_ready=False, deadlines=deadlines,
                                policy=POLICY, now=at(t))

    assert check(job, 10).changed is False  # too early
    first = check(job, 16)
    (event,) = first.events
    original = job.current
    assert isinstance(event, GangAllocated)
    assert (event.allocation_id, event.epoch, event.attempt) == (original.allocation_id, original.epoch, 1)
    assert [(n.node_id, [r.rank for r in n.ranks]) for n in event.nodes] == [("n1", [0, 1])]
    assert first.job.current.republished == 1 and first.job.current.republished_at == at(16)
    assert check(first.job, 20).changed is False  # spaced by republish_after_s
    second = check(first.job, 32)
    assert second.job.current.republished == 2
    assert check(second.job, 100).changed is False  # at most republish_max times
    started_all = running(job)
    assert check(started_all, 50).changed is False  # every rank started: nothing to do
    timed_out = check(second.job, 121)
    assert timed_out.job.state == "queued" and timed_out.blame == [("n1", "start-timeout")]


def test_backfill_duration_is_the_spec_estimate_scaled_to_what_is_left() -> None:
    from trainyard_scheduler.queueview import remaining_seconds as _remaining_seconds

    assert _remaining_seconds(new_job()) is None  # no estimate: never backfilled past a reservation
    spec = SPEC.model_copy(update={"resources": SPEC.resources.model_copy(update={"expected_duration_minutes": 10})})
    job = JobRecord(job_id="j2", tenant="t1", spec=spec, spec_hash=spec.spec_hash(), created_at=T0)
    assert _remaining_seconds(job) == 600.0
    resumed = admitted(job, start=CheckpointRef(manifest_uri="file:///m", global_step=15, attempt=1))
    assert _remaining_seconds(resumed) == pytest.approx(150.0)  # 5 of 20 steps left


# ----------------------------------------------------------------------------- waiting for a settling checkpoint


def ended_attempt(job: JobRecord, *, at_s: float) -> JobRecord:
    """``job`` with its first attempt failed at ``at_s``."""
    job = admitted(job)
    attempt = job.attempts[0].model_copy(update={"state": "failed", "ended_at": at(at_s)})
    return job.model_copy(update={"state": "queued", "attempts": [attempt]})


def record(step: int, state: str = "PENDING", attempt: int = 1) -> CheckpointRecord:
    return CheckpointRecord(job_id="j1", tenant="t1", attempt=attempt, epoch=1, global_step=step, world_size=2,
                            state=state, created_at=at(0))


def test_the_next_attempt_waits_for_a_complete_checkpoint_that_is_not_ready_yet() -> None:
    job = ended_attempt(new_job(), at_s=100)
    records = [record(10, "READY"), record(20)]
    waiting = tr.checkpoint_settling(job, records, {"step-000000020-a1": 2}, now=at(101), settle_s=15)
    assert waiting is not None and waiting.global_step == 20


def test_a_checkpoint_missing_shards_or_older_than_the_latest_ready_one_is_not_waited_for() -> None:
    job = ended_attempt(new_job(), at_s=100)
    assert tr.checkpoint_settling(job, [record(20)], {"step-000000020-a1": 1},
                                  now=at(101), settle_s=15) is None  # its other rank is gone
    assert tr.checkpoint_settling(job, [record(10), record(20, "READY")], {"step-000000010-a1": 2},
                                  now=at(101), settle_s=15) is None  # a newer one is READY already
    assert tr.checkpoint_settling(job, [record(20, attempt=0)], {"step-000000020-a0": 2},
                                  now=at(101), settle_s=15) is None  # not the attempt that just ended


def test_the_wait_for_a_settling_checkpoint_is_bounded_and_can_be_turned_off() -> None:
    job = ended_attempt(new_job(), at_s=100)
    records, recorded = [record(20)], {"step-000000020-a1": 2}
    assert tr.checkpoint_settling(job, records, recorded, now=at(114), settle_s=15) is not None
    assert tr.checkpoint_settling(job, records, recorded, now=at(115), settle_s=15) is None
    assert tr.checkpoint_settling(job, records, recorded, now=at(101), settle_s=0) is None
    assert tr.checkpoint_settling(admitted(new_job()), records, recorded, now=at(1), settle_s=15) is None  # running


# ------------------------------------------------------------------ user code: success without a final checkpoint


def code_job() -> JobRecord:
    from trainyard_contract.spec import Code

    spec = SPEC.model_copy(update={"code": Code(archive="sha256:" + "a" * 64, entrypoint=["python", "train.py"])})
    return JobRecord(job_id="j1", tenant="t1", spec=spec, spec_hash=spec.spec_hash(), created_at=T0)


def exit_all(job: JobRecord, *, saved: int | None) -> tr.Outcome:
    outcome = tr.worker_exited(job, exited(job, 0).model_copy(update={"saved_step": saved}),
                               final_ready=False, policy=POLICY, now=at(5))
    return tr.worker_exited(outcome.job, exited(outcome.job, 1).model_copy(update={"saved_step": saved}),
                            final_ready=False, policy=POLICY, now=at(5))


def test_a_script_that_saved_no_final_checkpoint_succeeds_when_every_rank_exits_0() -> None:
    outcome = exit_all(running(admitted(code_job())), saved=None)
    assert outcome.job.state == "succeeded" and states(outcome) == ["succeeded"]
    assert outcome.job.current is not None and not outcome.job.current.final_saved


def test_a_script_that_saved_its_last_step_succeeds_only_once_that_checkpoint_is_ready() -> None:
    outcome = exit_all(running(admitted(code_job())), saved=SPEC.training.max_steps)
    assert outcome.job.state == "running" and outcome.job.current.final_saved  # type: ignore[union-attr]  # present here (the test asserts it)
    done = tr.checkpoint_ready(outcome.job, global_step=SPEC.training.max_steps, now=at(6))
    assert done.job.state == "succeeded"


def test_the_built_in_trainer_still_needs_its_final_checkpoint() -> None:
    outcome = exit_all(running(admitted(new_job())), saved=None)
    assert outcome.job.state == "running"  # waits for the READY checkpoint at maxSteps


def violation(job: JobRecord, *, tenant: str = "t1", attempt: int = 1) -> SecurityViolation:
    return SecurityViolation(job_id=job.job_id, tenant=tenant, attempt=attempt, allocation_id="alloc-1", epoch=1,
                             node_id="n1", rank=1, detail="a rank may not publish 'JobControlRequested' events",
                             refused_event_type="JobControlRequested")


def test_a_security_violation_fails_the_job_at_once_without_retry_or_blame() -> None:
    job = running(admitted(new_job(max_attempts=5)))
    outcome = tr.security_violation(job, violation(job), at(5))
    assert outcome.job.state == "failed" and states(outcome) == ["failed"]
    assert (outcome.job.reason or "").startswith("security: rank 1 of attempt 1 on n1: a rank may not publish")
    revoked = [e for e in outcome.events if isinstance(e, AllocationRevoked)]
    assert len(revoked) == 1 and revoked[0].allocation_id == "alloc-1"
    assert outcome.release is not None and outcome.blame == []
    # the ranks' exits that follow (reason security, or errors of their peers) change nothing
    after = tr.worker_exited(outcome.job, exited(job, 0, code=1, reason="error"), final_ready=False,
                             policy=tr.JOB_RETRY, now=at(6))
    assert after.job.state == "failed" and len(after.job.attempts) == 1


def test_a_violation_of_an_old_attempt_still_fails_the_job_and_one_for_an_ended_job_changes_nothing() -> None:
    job = running(admitted(new_job()))
    assert tr.security_violation(job, violation(job, attempt=0), at(5)).job.state == "failed"
    failed = tr.security_violation(job, violation(job), at(5)).job
    assert not tr.security_violation(failed, violation(job), at(6)).changed
    assert not tr.security_violation(job, violation(job, tenant="t2"), at(6)).changed


# --------------------------------------------------------------------------- datasets of a submitted job


def _dataset(tenant: str | None, shared_with: list[str] | None = None) -> DatasetRecord:
    return DatasetRecord(name="wiki", version="v1", tenant=tenant, shared_with=shared_with or [],
                         manifest_uri="file:///x/manifest.json", sha256="a" * 64)


@pytest.mark.parametrize(("ref", "tenant", "record", "refused"), [
    ("a/wiki@v1", "a", _dataset("a"), False),            # its own
    ("a/wiki@v1", "b", _dataset("a"), True),             # another tenant's, not shared (a forged event)
    ("a/wiki@v1", "b", _dataset("a", ["b"]), False),     # shared with it
    ("a/wiki@v1", "b", _dataset("a", ["*"]), False),     # shared with every tenant
    ("a/wiki@v1", "a", None, True),                      # a tenant's ref never passes unverified
    ("wiki@v1", "b", _dataset(None), False),             # the platform's
    ("wiki@v1", "b", None, True),                        # the platform's files, never verified: read by no job
])
def test_dataset_refusal(ref: str, tenant: str, record: DatasetRecord | None, refused: bool) -> None:
    reason = tr.dataset_refusal(ref, tenant, record)
    assert (reason is not None) is refused
    if reason is not None:
        assert repr(ref) in reason
