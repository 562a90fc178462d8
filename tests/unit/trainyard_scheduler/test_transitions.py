"""The job/attempt state machine: pure transitions, both orders of the success conditions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from trainyard_common.events import (
    AllocationRevoked,
    CheckpointRef,
    CheckpointRequested,
    DeviceInfo,
    GangAllocated,
    JobStateChanged,
    WorkerExited,
    WorkerStarted,
)
from trainyard_common.records import JobRecord
from trainyard_common.spec import TrainingSpec
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.placement import ClusterSnapshot, GangRequest, NodeView, Placement, place

T0 = datetime(2025, 1, 1, tzinfo=UTC)
POLICY = tr.RetryPolicy(backoff_s=2.0, max_backoff_s=10.0)
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


def exited(job: JobRecord, rank: int, code: int = 0, reason: str = "ok", *, epoch: int | None = None) -> WorkerExited:
    a = job.current
    assert a is not None
    return WorkerExited(job_id=job.job_id, attempt=a.attempt, allocation_id=a.allocation_id,
                        epoch=a.epoch if epoch is None else epoch, node_id="n1", rank=rank, exit_code=code,
                        reason=reason)


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
    assert job.reason.startswith("killed: rank 0 on n1 exited with code -9 (attempt 2, 2 of 2 failed)")
    assert not tr.is_pending(job)


def test_non_retryable_reason_fails_at_once() -> None:
    job = running(admitted(new_job()))
    outcome = tr.worker_exited(job, exited(job, 0, code=3, reason="nan"), final_ready=False, policy=POLICY,
                               now=at(5))
    assert outcome.job.state == "failed" and states(outcome) == ["failed"]
    assert outcome.job.reason.startswith("nan:") and "not retryable" in outcome.job.reason


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
    ("running", "pause", "paused", True),
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


def test_pause_then_resume_requeues_without_spending_an_attempt() -> None:
    job = running(admitted(new_job()))
    paused = tr.request_control(job, "pause", None, at(5)).job
    assert paused.current.state == "revoked" and tr.failures(paused) == 0
    assert tr.request_control(paused, "pause", None, at(6)).changed is False
    resumed = tr.request_control(paused, "resume", None, at(7))
    assert resumed.job.state == "queued" and states(resumed) == ["queued"]
    assert tr.is_pending(resumed.job) and tr.retry_not_before(resumed.job, POLICY) is None
    again = admitted(resumed.job, epoch=2)
    assert again.current.attempt == 2


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
    outcome = tr.checkpoint_failed(job, global_step=20, reason="shard 1 missing", policy=POLICY, now=at(11))
    assert outcome.job.state == "queued" and tr.is_pending(outcome.job)
    assert "the checkpoint at step 20 failed: shard 1 missing" in outcome.job.current.failure_reason


def test_reconcile_times_out_a_gang_that_only_partly_started() -> None:
    job = admitted(new_job())
    job = tr.worker_started(job, started(job, 0), at(1)).job
    kw = {"available_nodes": frozenset({"n1"}), "final_ready": False, "deadlines": DEADLINES, "policy": POLICY}
    outcome = tr.check_attempt(job, now=at(61), **kw)
    assert outcome.job.current.failure_reason.startswith("start-timeout: 1 of 2 ranks started")
    assert tr.check_attempt(running(admitted(new_job())), now=at(61), **kw).changed is False


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


@pytest.mark.parametrize(("ready_step", "now", "revoked", "how"), [
    (10, 120, False, None),  # no newer checkpoint, grace not over
    (20, 120, True, "the checkpoint at step 20 is READY"),
    (10, 161, True, "no new checkpoint within 60s; it resumes from the last READY one"),
])
def test_preemption_ends_at_a_newer_checkpoint_or_the_deadline(ready_step: int, now: float, revoked: bool,
                                                               how: str | None) -> None:
    job = preempted(running(admitted(new_job()))).job
    outcome = tr.check_preemption(job, latest_ready_step=ready_step, preemptor_waiting=True, grace_s=60, now=at(now))
    assert outcome.changed is revoked
    if not revoked:
        return
    assert outcome.job.state == "queued" and states(outcome) == ["queued"]
    assert outcome.job.current.state == "revoked" and tr.failures(outcome.job) == 0  # not a failure
    assert outcome.job.current.failure_reason == f"preempted by urgent: {how}"
    assert outcome.job.queued_reason_kind == "priority" and "preempted by urgent" in outcome.job.queued_reason
    revocations = [e for e in outcome.events if isinstance(e, AllocationRevoked)]
    assert len(revocations) == 1 and revocations[0].reason == "preempted by urgent"
    assert outcome.release is not None and tr.is_pending(outcome.job)


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


def test_ranks_that_answer_the_checkpoint_request_end_the_attempt_without_a_failure() -> None:
    job = preempted(running(admitted(new_job()))).job
    outcome = tr.worker_exited(job, exited(job, 0, code=143, reason="preempted"), final_ready=False,
                               policy=POLICY, now=at(130))
    assert outcome.job.state == "queued" and outcome.job.current.state == "revoked"
    assert outcome.job.current.failure_reason == "preempted by urgent: its ranks checkpointed and stopped"
    assert tr.failures(outcome.job) == 0 and outcome.release is not None
    # a "preempted" exit nobody asked for (e.g. a spot reclaim) is an ordinary retryable failure
    plain = running(admitted(new_job()))
    failed = tr.worker_exited(plain, exited(plain, 0, code=143, reason="preempted"), final_ready=False,
                              policy=POLICY, now=at(5))
    assert failed.job.state == "queued" and failed.job.current.state == "failed"
