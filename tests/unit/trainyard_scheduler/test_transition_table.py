"""The job state machine's table, row by row: each row is driven through the real transition from a job in
its state (and the row the transition took is the one expected); every pair not in the table is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from trainyard_contract.events import EnvironmentPreparing, JobState, SecurityViolation
from trainyard_contract.records import JobRecord
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.blame import Silence
from trainyard_scheduler.transitions import table
from trainyard_scheduler.transitions.table import JOB_STATES, SAME, TABLE, Happening, Row

from tests.unit.trainyard_scheduler import test_replicas as replicas
from tests.unit.trainyard_scheduler.test_transitions import (
    DEADLINES,
    POLICY,
    admitted,
    at,
    exited,
    new_job,
    placement,
    running,
    started,
)

H = Happening
LIVE: tuple[str, ...] = ("queued", "running")
ACTIVE: tuple[str, ...] = ("queued", "running", "paused")
RETRY = {"queued", "paused", "failed"}
REQUEUE = {"queued", "paused"}
REV, ASK, GANG = {"AllocationRevoked"}, {"CheckpointRequested"}, {"GangAllocated"}

# (states, happening) -> (next states, what it may publish besides JobStateChanged): the design, spelled out
EXPECTED: list[tuple[tuple[str, ...], Happening, set[str], set[str]]] = [
    (("queued",), H.PLACED, {"queued"}, GANG),
    (ACTIVE, H.UNSTARTABLE, {"failed"}, set()),
    (ACTIVE, H.SECURITY_VIOLATION, {"failed"}, REV),
    (("queued",), H.WAIT_NOTED, {SAME}, set()),
    (LIVE, H.RANK_STARTED, {"running"}, set()),
    (LIVE, H.ENVIRONMENT_NOTED, {SAME}, set()),
    (JOB_STATES, H.EXIT_RECORDED, {SAME}, set()),
    (LIVE, H.RANK_STOPPED, {SAME, "queued", "paused", "succeeded"}, REV),
    (LIVE, H.PORT_SQUATTED, REQUEUE, REV),
    (LIVE, H.RANK_FAILED, RETRY, REV),
    (LIVE, H.REPLICA_FAILED, {SAME}, {"ReplicaReplaced"}),
    (LIVE, H.RANK_DONE, {SAME}, set()),
    (LIVE, H.ATTEMPT_COMPLETED, {SAME, "succeeded"}, set()),
    (ACTIVE, H.FINAL_READY, {"succeeded"}, set()),
    (ACTIVE, H.FINAL_FAILED, RETRY, REV),
    (("running",), H.FINAL_LATE, {"succeeded"}, set()),
    (("running",), H.FINAL_MISSING, RETRY, REV),
    (ACTIVE, H.CANCEL, {"cancelled"}, REV),
    (LIVE, H.PAUSE, {"paused"}, REV),
    (LIVE, H.PAUSE_ASKED, {SAME}, ASK),
    (("running",), H.PAUSE_AFTER_COMPLETION, {SAME}, set()),
    (LIVE, H.PAUSE_WITHDRAWN, {SAME}, set()),
    (("paused",), H.RESUME, {"queued"}, set()),
    (ACTIVE, H.COMPLETED_BY_CONTROL, {"succeeded"}, REV),
    (LIVE, H.PREEMPT_ASKED, {SAME}, ASK),
    (LIVE, H.PREEMPTION_WITHDRAWN, {SAME}, set()),
    (LIVE, H.DRAIN_ASKED, {SAME}, ASK),
    (LIVE, H.DRAIN_BEFORE_START, REQUEUE, REV),
    (LIVE, H.STOP_ENDED, {"queued", "paused", "succeeded"}, REV),
    (LIVE, H.CLUSTER_SILENT, REQUEUE, REV),
    (LIVE, H.NODE_SILENT, RETRY, REV),
    (LIVE, H.START_TIMEOUT_UNWATCHED, REQUEUE, REV),
    (LIVE, H.START_TIMEOUT, RETRY, REV),
    (LIVE, H.REPUBLISH, {SAME}, GANG),
]
ROWS = [(state, happening) for states, happening, _, _ in EXPECTED for state in states]


def test_the_table_is_the_design() -> None:
    spelled = {(state, happening): (to, publishes) for states, happening, to, publishes in EXPECTED
               for state in states}
    assert {key: (set(r.to), {t.__name__ for t in r.publishes}) for key, r in TABLE.items()} == spelled
    assert {h for _, h in TABLE} == set(Happening)  # every happening has a row somewhere


# ----------------------------------------------------------------------------- scenarios, one per happening


def forced(job: JobRecord, state: JobState) -> JobRecord:
    """``job`` as if it were in ``state`` (the rows say what each state may do; the record does the rest)."""
    return job.model_copy(update={"state": state})


def completed(job: JobRecord) -> JobRecord:
    """Every rank exited 0; the final checkpoint not READY yet."""
    for rank in range(2):
        job = tr.worker_exited(job, exited(job, rank), final_ready=False, policy=POLICY, now=at(5)).job
    assert job.current is not None and job.current.state == "succeeded"
    return job


def ended(job: JobRecord) -> JobRecord:
    attempt = job.attempts[-1].model_copy(update={"state": "failed"})
    return job.model_copy(update={"attempts": [*job.attempts[:-1], attempt]})


def exit_of(job: JobRecord, state: JobState, code: int, reason: str, rank: int = 1) -> tr.Outcome:
    job = forced(job, state)
    return tr.worker_exited(job, exited(job, rank, code=code, reason=reason, step=12), final_ready=False,
                            policy=POLICY, now=at(10), latest_ready_step=10)


def check(job: JobRecord, state: JobState, now: float, **kwargs: object) -> tr.Outcome:
    defaults: dict[str, object] = {"available_nodes": frozenset({"n1"}), "final_ready": False,
                                   "deadlines": DEADLINES, "policy": POLICY, "now": at(now)}
    return tr.check_attempt(forced(job, state), **{**defaults, **kwargs})  # type: ignore[arg-type]  # test kwargs


def asked_to_stop(job: JobRecord) -> JobRecord:
    return tr.request_preemption(job, by="urgent", reason="priority", latest_ready_step=10, grace_s=30,
                                 now=at(2)).job


def violation(job: JobRecord) -> SecurityViolation:
    return SecurityViolation(job_id=job.job_id, tenant=job.tenant, attempt=1, node_id="n1", rank=0,
                             detail="forged", allocation_id="alloc-1", epoch=1)


def control(job: JobRecord, state: JobState, action: str, **kwargs: object) -> tr.Outcome:
    return tr.request_control(forced(job, state), action, None, at(3), **kwargs)  # type: ignore[arg-type]  # a test double


SCENARIOS: dict[Happening, Callable[[JobState], tr.Outcome]] = {
    H.PLACED: lambda s: tr.admit(forced(new_job(), s), placement=placement(), allocation_id="a1", epoch=1,
                                 master_port=29400, start_checkpoint=None, now=at(0)),
    H.UNSTARTABLE: lambda s: tr.fail_unstartable(forced(new_job(), s), "no such checkpoint", at(0)),
    H.SECURITY_VIOLATION: lambda s: tr.security_violation(forced(running(admitted(new_job())), s),
                                                          violation(new_job()), at(3)),
    H.WAIT_NOTED: lambda s: tr.note_waiting(forced(new_job(), s), "waiting for devices", "capacity"),
    H.RANK_STARTED: lambda s: tr.worker_started(forced(j := admitted(new_job()), s), started(j, 0), at(1)),
    H.ENVIRONMENT_NOTED: lambda s: tr.environment_noted(forced(j := admitted(new_job()), s), building(j), at(1)),
    H.EXIT_RECORDED: lambda s: exit_of(ended(running(admitted(new_job()))), s, 1, "error"),
    H.RANK_STOPPED: lambda s: exit_of(running(admitted(new_job())), s, 7, "preempted"),
    H.PORT_SQUATTED: lambda s: exit_of(admitted(new_job()), s, 127, "port-in-use", rank=0),
    H.RANK_FAILED: lambda s: exit_of(running(admitted(new_job())), s, 1, "error"),
    H.REPLICA_FAILED: lambda s: exit_of(replicas.running_job(), s, 137, "killed"),
    H.RANK_DONE: lambda s: exit_of(running(admitted(new_job())), s, 0, "ok"),
    H.ATTEMPT_COMPLETED: lambda s: exit_of(tr.worker_exited(
        (j := running(admitted(new_job()))), exited(j, 0), final_ready=False, policy=POLICY, now=at(5)).job,
        s, 0, "ok"),
    H.FINAL_READY: lambda s: tr.checkpoint_ready(forced(completed(running(admitted(new_job()))), s),
                                                 global_step=20, now=at(6)),
    H.FINAL_FAILED: lambda s: tr.checkpoint_failed(forced(completed(running(admitted(new_job()))), s),
                                                   global_step=20, reason="disk", policy=POLICY, now=at(6)),
    H.FINAL_LATE: lambda s: check(completed(running(admitted(new_job()))), s, 6, final_ready=True),
    H.FINAL_MISSING: lambda s: check(completed(running(admitted(new_job()))), s, 500),
    H.CANCEL: lambda s: control(running(admitted(new_job())), s, "cancel"),
    H.PAUSE: lambda s: control(admitted(new_job()), s, "pause"),
    H.PAUSE_ASKED: lambda s: control(running(admitted(new_job())), s, "pause", latest_ready_step=10),
    H.PAUSE_AFTER_COMPLETION: lambda s: control(completed(running(admitted(new_job()))), s, "pause"),
    H.PAUSE_WITHDRAWN: lambda s: control(control(running(admitted(new_job())), s, "pause").job, s, "resume"),
    H.RESUME: lambda s: control(new_job(), s, "resume"),
    H.COMPLETED_BY_CONTROL: lambda s: control(new_job(), s, "resume" if s == "paused" else "pause",
                                              final_ready=True),
    H.PREEMPT_ASKED: lambda s: tr.request_preemption(forced(running(admitted(new_job())), s), by="urgent",
                                                     reason="priority", latest_ready_step=10, grace_s=30, now=at(2)),
    H.PREEMPTION_WITHDRAWN: lambda s: tr.check_preemption(
        forced(asked_to_stop(running(admitted(new_job()))), s), latest_ready_step=10, preemptor_waiting=False,
        grace_s=30, now=at(3)),
    H.DRAIN_ASKED: lambda s: tr.request_drain(forced(running(admitted(new_job())), s), reason="kernel update",
                                              latest_ready_step=10, grace_s=30, now=at(2)),
    H.DRAIN_BEFORE_START: lambda s: tr.request_drain(forced(admitted(new_job()), s), reason="kernel update",
                                                     latest_ready_step=None, grace_s=30, now=at(2)),
    H.STOP_ENDED: lambda s: tr.check_preemption(
        forced(asked_to_stop(running(admitted(new_job()))), s), latest_ready_step=10, preemptor_waiting=True,
        grace_s=30, now=at(100)),
    H.CLUSTER_SILENT: lambda s: check(running(admitted(new_job())), s, 10, available_nodes=frozenset(),
                                      judge=lambda nodes: Silence("control-plane", ("n1",), "all silent")),
    H.NODE_SILENT: lambda s: check(running(admitted(new_job())), s, 10, available_nodes=frozenset()),
    H.START_TIMEOUT_UNWATCHED: lambda s: check(admitted(new_job()), s, 100, watched_s=5.0),
    H.START_TIMEOUT: lambda s: check(admitted(new_job()), s, 100),
    H.REPUBLISH: lambda s: check(admitted(new_job()), s, 30,
                                 deadlines=tr.Deadlines(start_timeout_s=60.0, republish_after_s=10.0,
                                                        republish_max=2)),
}


def building(job: JobRecord) -> EnvironmentPreparing:
    a = job.current
    assert a is not None
    return EnvironmentPreparing(job_id=job.job_id, attempt=a.attempt, allocation_id=a.allocation_id, epoch=a.epoch,
                                node_id="n1", environment="sha256:" + "e" * 64, state="building", packages=3)


def test_every_happening_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(Happening)


@pytest.mark.parametrize(("state", "happening"), ROWS, ids=[f"{s}-{h.value}" for s, h in ROWS])
def test_row(state: JobState, happening: Happening, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[tuple[str, Happening]] = []
    lookup = table.row

    def spy(s: JobState, h: Happening) -> Row | None:
        taken.append((s, h))
        return lookup(s, h)

    monkeypatch.setattr(table, "row", spy)
    outcome = SCENARIOS[happening](state)
    assert taken[-1:] == [(state, happening)], f"the scenario took {taken}"
    assert outcome.changed, outcome.note
    found = TABLE[(state, happening)]
    assert found.allows(state, outcome.job.state)


def test_outcome_outside_its_row_is_a_bug() -> None:
    job = running(admitted(new_job()))
    with pytest.raises(tr.TransitionTableError):  # a RESUME that went to failed
        table.enter(forced(job, "paused"), H.RESUME, lambda: tr.Outcome(forced(job, "failed")))


REFUSED = [(s, h) for s in JOB_STATES for h in Happening if (s, h) not in TABLE]


@pytest.mark.parametrize(("state", "happening"), REFUSED, ids=[f"{s}-{h.value}" for s, h in REFUSED])
def test_every_other_pair_is_refused(state: JobState, happening: Happening) -> None:
    job = forced(running(admitted(new_job())), state)
    called: list[bool] = []
    outcome = table.enter(job, happening, lambda: called.append(True) or tr.Outcome(job))  # type: ignore[func-returns-value]  # append returns None, on purpose
    assert not called and not outcome.changed and outcome.job is job
    assert outcome.note == f"{happening.value} refused: the job is {state}"


def test_terminal_states_only_record_late_exits() -> None:
    for state in ("succeeded", "failed", "cancelled"):
        assert {h for (s, h) in TABLE if s == state} == {H.EXIT_RECORDED}


@pytest.mark.parametrize(("reason", "recorded", "state"), [
    ("gpu-fell-off-the-bus", "gpu-fell-off-the-bus", "failed"),  # unknown: not retried, kept as given
    ("", "error", "queued"),  # no reason: an error, retried
    ("signal-11", "signal", "queued"),
    ("port-in-use", None, "queued"),  # an interruption: no failure recorded
])
def test_a_rank_exit_reason_decides_through_exit_reason(reason: str, recorded: str | None, state: str) -> None:
    outcome = exit_of(running(admitted(new_job())), "running", 1 if reason != "port-in-use" else 127, reason)
    assert outcome.job.state == state
    attempt = outcome.job.attempts[-1]
    if recorded is None:
        assert attempt.state == "revoked" and outcome.blame == [] and tr.failures(outcome.job) == 0
    else:
        assert attempt.state == "failed" and (attempt.failure_reason or "").startswith(f"{recorded}: ")
        assert outcome.blame == [("n1", recorded)]
