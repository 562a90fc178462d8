"""The job and attempt state machine, as pure functions over a :class:`JobRecord`.

Each function takes the current record (never mutated) and what happened, and returns an
:class:`Outcome`: the new record, the events to publish with it (staged in the same Redis MULTI
through the outbox), the attempt whose device leases to release afterwards, and the nodes to blame
for a failure (node reputation). No Redis, Kafka or clock inside: ``now`` is passed in.

Job states::

    queued ──(WorkerStarted)──> running ──(all ranks exit 0 + READY ckpt at maxSteps)──> succeeded
      ^  │                         │
      │  └──(pause)──> paused <────┘ pause: checkpoint first, then revoke; resume → queued
      └── attempt failed, retryable, budget left (back-off, resume from latest READY)
    any non-terminal ──(cancel)──> cancelled (revoked at once; READY checkpoints are kept);
    attempt failed, not retryable or budget spent ──> failed

Every transition is a row of :data:`~trainyard_scheduler.transitions.table.TABLE`: (job state, what
happened) → (the states it may end in, the events it may publish); a pair not in it is refused
(``table``). Attempt states: starting → running → succeeded | failed | revoked. An attempt is *live*
(holds leases, has ranks) while starting or running. Attempts revoked by pause, cancel or preemption
never count as failures, nor do attempts *interrupted* (``AttemptRecord.interruption``,
``ExitReason.interruption``): by maintenance (a drain), by the control plane (most of the cluster went
silent together) or by a squatter (``port-in-use``). By concern:

* ``table``     — the transition table, and the gate every transition goes through;
* ``state``     — :class:`Outcome`, the job's :class:`RetryPolicy`, :class:`Deadlines`, predicates over a record;
* ``admission`` — placement (GangAllocated), a job that can never start, a security violation;
* ``workers``   — ranks started and exited, the final checkpoint READY or failed;
* ``retry``     — a failed attempt: retried or the job failed (the retry policy);
* ``stops``     — checkpoint, then stop (pause, drain, preemption: one rule), and interruptions;
* ``control``   — cancel, pause, resume;
* ``reconcile`` — the periodic check: silent nodes, start time-outs, lost events.

docs/design.md §3.7 and docs/failures.md tell the rules in prose.
"""

from trainyard_scheduler.transitions.admission import (
    admit,
    dataset_refusal,
    fail_unstartable,
    gang_allocated,
    note_waiting,
    security_violation,
)
from trainyard_scheduler.transitions.control import request_control
from trainyard_scheduler.transitions.reconcile import check_attempt
from trainyard_scheduler.transitions.state import (
    JOB_RETRY,
    LIVE_ATTEMPT_STATES,
    Deadlines,
    Outcome,
    RetryPolicy,
    checkpoint_settling,
    failures,
    failures_since_progress,
    is_final_step,
    is_live,
    is_pending,
    is_stopping,
    made_progress,
    rank0_host,
    rank_nodes,
    retry_not_before,
    stop_checkpoint,
    unchanged,
)
from trainyard_scheduler.transitions.stops import check_preemption, request_drain, request_preemption
from trainyard_scheduler.transitions.table import TABLE, Happening, Row, TransitionTableError
from trainyard_scheduler.transitions.workers import (
    checkpoint_failed,
    checkpoint_ready,
    worker_exited,
    worker_runs,
    worker_started,
    workers_started,
    environment_noted,
)

__all__ = [
    "JOB_RETRY", "LIVE_ATTEMPT_STATES", "TABLE", "Deadlines", "Happening", "Outcome", "RetryPolicy", "Row",
    "TransitionTableError", "admit", "check_attempt", "check_preemption", "checkpoint_failed", "checkpoint_ready",
    "checkpoint_settling", "dataset_refusal", "fail_unstartable", "failures", "failures_since_progress",
    "gang_allocated", "is_final_step", "is_live", "is_pending", "is_stopping", "made_progress", "note_waiting",
    "rank0_host", "rank_nodes", "request_control", "request_drain", "request_preemption", "retry_not_before",
    "security_violation", "stop_checkpoint", "unchanged", "worker_exited", "worker_runs", "worker_started",
    "workers_started", "environment_noted",
]
