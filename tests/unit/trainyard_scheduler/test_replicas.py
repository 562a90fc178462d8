"""Fault-tolerant attempts: a failed replica is replaced while the others train on, or the attempt ends the usual
way (pure transitions)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from trainyard_contract.events import AllocationRevoked, GangAllocated, ReplicaReplaced, WorkerExited, WorkerStarted
from trainyard_contract.records import JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.gang import GangRequest, Placement
from trainyard_scheduler.placement import place
from trainyard_scheduler.ports import live_ports
from trainyard_scheduler.topology import ClusterSnapshot, NodeView
from trainyard_scheduler.transitions.replicas import MAX_REPLACEMENTS_PER_RANK, replicas_running
from trainyard_contract.events import DeviceInfo

T0 = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = tr.RetryPolicy(initial_interval_s=2.0, maximum_interval_s=10.0)


def spec(replicas: int = 3, min_replicas: int = 2) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "t",
        "resources": {"gpuType": "cpu", "gpuCount": replicas}, "parallelism": {"data": replicas},
        "checkpointPolicy": {"everySteps": 10},
        "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": replicas, "learningRate": 0.001,
                     "maxSteps": 50},
        "faultTolerance": {"replicas": replicas, "minReplicas": min_replicas},
    })


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def running_job(replicas: int = 3, min_replicas: int = 2) -> JobRecord:
    s = spec(replicas, min_replicas)
    job = JobRecord(job_id="j1", tenant="t1", spec=s, spec_hash=s.spec_hash(), created_at=T0, max_attempts=3)
    devices = tuple(DeviceInfo(index=i, type="cpu", memory_bytes=0) for i in range(4))
    placed = place(ClusterSnapshot((NodeView("n1", "127.0.0.1", devices),)), GangRequest("cpu", replicas))
    assert isinstance(placed, Placement)
    outcome = tr.admit(job, placement=placed, allocation_id="a1", epoch=1, master_port=29400,
                       start_checkpoint=None, now=at(0), lighthouse_port=29401)
    (gang,) = outcome.events
    assert isinstance(gang, GangAllocated) and gang.lighthouse_port == 29401
    job = outcome.job
    return tr.workers_started(job, [started(job, r) for r in range(replicas)], at(1)).job


def started(job: JobRecord, rank: int, generation: int = 0) -> WorkerStarted:
    a = job.current
    assert a is not None
    return WorkerStarted(job_id=job.job_id, attempt=a.attempt, allocation_id=a.allocation_id, epoch=a.epoch,
                         node_id="n1", rank=rank, pid=100 + rank, log_uri="file:///log", generation=generation)


def exited(job: JobRecord, rank: int, code: int = 137, reason: str = "killed", generation: int = 0,
           step: int | None = 12) -> WorkerExited:
    a = job.current
    assert a is not None
    return WorkerExited(job_id=job.job_id, attempt=a.attempt, allocation_id=a.allocation_id, epoch=a.epoch,
                        node_id="n1", rank=rank, exit_code=code, reason=reason, global_step=step,
                        generation=generation)


def fail(job: JobRecord, event: WorkerExited, seconds: float = 5) -> tr.Outcome:
    return tr.worker_exited(job, event, final_ready=False, policy=POLICY, now=at(seconds))


def test_a_killed_replica_is_replaced_and_the_attempt_goes_on() -> None:
    job = running_job()
    outcome = fail(job, exited(job, 1))
    (event,) = outcome.events
    assert isinstance(event, ReplicaReplaced)
    assert (event.rank, event.generation, event.node_id, event.reason, event.epoch) == (1, 1, "n1", "killed", 1)
    attempt = outcome.job.current
    assert attempt is not None and attempt.state == "running" and outcome.job.state == "running"
    assert len(outcome.job.attempts) == 1 and outcome.release is None
    assert attempt.generations == {"1": 1} and "1" not in attempt.exited_ranks
    assert outcome.blame == [("n1", "killed")]  # the usual evidence: its node's reputation
    assert replicas_running(attempt) == 2
    (replacement,) = attempt.replacements
    assert replacement.global_step == 12 and replacement.started_at is None

    # the newcomer starts: running again, with three replicas
    back = tr.workers_started(outcome.job, [started(outcome.job, 1, generation=1)], at(8))
    assert back.changed
    again = back.job.current
    assert again is not None and again.replacements[0].started_at == at(8) and replicas_running(again) == 3
    # its WorkerStarted again (redelivered): nothing
    assert not tr.workers_started(back.job, [started(back.job, 1, generation=1)], at(9)).changed


def test_news_of_a_replaced_generation_is_stale() -> None:
    job = running_job()
    replaced = fail(job, exited(job, 1)).job
    # the failed process's exit redelivered, or its late start: nothing changes
    assert not fail(replaced, exited(replaced, 1)).changed
    assert not tr.workers_started(replaced, [started(replaced, 1, generation=0)], at(7)).changed
    # the newcomer's own exit 0 at the end counts as its rank's
    newcomer = tr.workers_started(replaced, [started(replaced, 1, generation=1)], at(8)).job
    done = newcomer
    for rank, gen in ((0, 0), (1, 1), (2, 0)):
        done = fail(done, exited(done, rank, code=0, reason="ok", generation=gen, step=50), seconds=20).job
    assert done.current is not None and done.current.state == "succeeded"


def test_below_min_replicas_the_attempt_ends_the_usual_way() -> None:
    job = running_job(replicas=2, min_replicas=2)
    outcome = fail(job, exited(job, 0))
    assert not any(isinstance(e, ReplicaReplaced) for e in outcome.events)
    assert any(isinstance(e, AllocationRevoked) for e in outcome.events)
    attempt = outcome.job.attempts[0]
    assert attempt.state == "failed" and "fewer than minReplicas 2" in (attempt.failure_reason or "") + str(
        outcome.note)


def test_a_second_failure_while_the_first_newcomer_is_not_back_counts_it_down() -> None:
    job = running_job(replicas=3, min_replicas=2)
    one = fail(job, exited(job, 1)).job
    two = fail(one, exited(one, 2), seconds=6)
    assert any(isinstance(e, AllocationRevoked) for e in two.events)  # 1 of 3 left: below 2
    assert two.job.attempts[0].state == "failed"


@pytest.mark.parametrize("reason", ["nan", "config", "data", "lost", "security"])
def test_failures_every_replica_would_repeat_end_the_attempt(reason: str) -> None:
    job = running_job()
    outcome = fail(job, exited(job, 1, code=1, reason=reason))
    assert not any(isinstance(e, ReplicaReplaced) for e in outcome.events)
    assert outcome.job.attempts[0].state == "failed"


def test_a_replica_that_keeps_failing_ends_the_attempt() -> None:
    job = running_job()
    for generation in range(MAX_REPLACEMENTS_PER_RANK):
        job = fail(job, exited(job, 1, generation=generation)).job
        job = tr.workers_started(job, [started(job, 1, generation=generation + 1)], at(9)).job
    outcome = fail(job, exited(job, 1, generation=MAX_REPLACEMENTS_PER_RANK))
    assert not any(isinstance(e, ReplicaReplaced) for e in outcome.events)
    assert outcome.job.attempts[0].state == "failed"
    assert len(outcome.job.attempts[0].replacements) == MAX_REPLACEMENTS_PER_RANK


def test_a_job_without_fault_tolerance_is_not_replaced() -> None:
    job = running_job()
    plain = job.model_copy(update={"spec": job.spec.model_copy(update={"fault_tolerance": None})})
    outcome = fail(plain, exited(plain, 1))
    assert not any(isinstance(e, ReplicaReplaced) for e in outcome.events)


def test_the_lighthouse_port_is_held_while_the_attempt_lives() -> None:
    job = running_job()
    assert live_ports([job]) == {29400, 29401}


def test_the_spec_names_what_fault_tolerance_needs() -> None:
    with pytest.raises(ValueError, match="must equal parallelism.data"):
        TrainingSpec.model_validate({**spec().wire(), "faultTolerance": {"replicas": 2, "minReplicas": 1}})
    with pytest.raises(ValueError, match="minReplicas"):
        TrainingSpec.model_validate({**spec().wire(), "faultTolerance": {"replicas": 3, "minReplicas": 4}})
    with pytest.raises(ValueError, match="sharding must be ddp"):
        wire = spec().wire()
        wire["training"] = {**wire["training"], "sharding": "fsdp"}
        TrainingSpec.model_validate(wire)
    # a spec without it keeps its hash (the field is left out of the wire form)
    assert "faultTolerance" not in spec().model_copy(update={"fault_tolerance": None}).wire()


def test_the_attempt_completes_when_the_others_finish_before_a_newcomer_starts() -> None:
    job = running_job(replicas=3, min_replicas=1)
    job = fail(job, exited(job, 2)).job  # replaced; its newcomer never starts
    for rank in (0, 1):
        job = fail(job, exited(job, rank, code=0, reason="ok", step=50), seconds=20).job
    assert job.current is not None and job.current.state == "succeeded"
