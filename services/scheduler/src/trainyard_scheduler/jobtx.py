"""The job transaction: WATCH → a pure transition → MULTI (record, change log, outbox, active set).

Every change to a job record goes through :meth:`JobTransactions.apply`: WATCH the job key (and its
checkpoint records and the leader epoch when asked), read, decide with a pure function from
:mod:`trainyard_scheduler.transitions`, then write the record and stage its events in one MULTI. A
concurrent writer makes the MULTI fail — :meth:`JobTransactions.try_execute` says so with ``False``,
no exception — and the decision is taken again on fresh state. A write fenced by a leader epoch that is
no longer current raises :class:`~trainyard_contract.errors.StaleLeaderError`.

What follows a written change (leases released, the next pass woken, nodes blamed) is the scheduler's.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from opentelemetry import trace
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from trainyard_contract.errors import ConflictError, StaleLeaderError
from trainyard_contract.events import TERMINAL_STATES, ReplicaReplaced
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import CheckpointRecord, JobRecord
from trainyard_runtime.store import CHANGES_MAXLEN, Keys, stage_change
from trainyard_contract.tracing import current_traceparent, job_context

from trainyard_scheduler import transitions as tr
from trainyard_scheduler.keys import SchedulerKeys

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("trainyard.scheduler")
_MAX_RACES = 100
REPLICA_GRANT_TTL_S = 7 * 24 * 3600  # outlives any attempt that still runs the replica; then nothing to keep


@dataclass(frozen=True)
class Facts:
    """Durable facts a transition may need besides the job record (read under the same WATCH)."""

    final_ready: bool = False
    latest_ready_step: int | None = None


Decide = Callable[[JobRecord, Facts], tr.Outcome]


def checkpoint_facts(job: JobRecord, raw_records: list[str]) -> Facts:
    """Whether a READY checkpoint at ``maxSteps`` exists, and the latest READY step."""
    final, latest = False, None
    for raw in raw_records:
        record = CheckpointRecord.model_validate_json(raw)
        if record.state != "READY":
            continue
        latest = record.global_step if latest is None else max(latest, record.global_step)
        final = final or tr.is_final_step(job, record.global_step)
    return Facts(final, latest)


def _trace_id(traceparent: str | None) -> str | None:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) >= 3 else None


@contextlib.contextmanager
def job_span(job: JobRecord, name: str) -> Iterator[None]:
    """A span in the job's trace: under the current span when it already belongs to it."""
    same = _trace_id(current_traceparent()) == _trace_id(job.traceparent)
    ctx = contextlib.nullcontext() if same or not job.traceparent else job_context(job.traceparent)
    with ctx, _tracer.start_as_current_span(name, attributes={"trainyard.job_id": job.job_id}):
        yield


# Many records at once, each only if it is still the one read (its sha1), all under the leader epoch: why queued
# jobs wait (advisory notes; a record that changed meanwhile is noted again by a later pass). Returns the positions
# written (1-based among the records), or {-1}: a stale leader, nothing written.
_NOTE_MANY = """
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= tonumber(ARGV[1]) then return {-1} end
local written = {}
for i = 3, #KEYS do
  local base = 2 * (i - 3) + 3
  local current = redis.call('GET', KEYS[i])
  if current and redis.sha1hex(current) == ARGV[base] then
    redis.call('SET', KEYS[i], ARGV[base + 1])
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'kind', 'job', 'id', string.sub(KEYS[i], 8))
    written[#written + 1] = i - 2
  end
end
return written
"""


class JobTransactions:
    """Optimistic read → decide → write of one job record at a time (and :meth:`write_if_unchanged`, many)."""

    def __init__(self, redis: Redis, outbox: Outbox) -> None:
        self.redis, self.outbox = redis, outbox
        self._note_many = redis.register_script(_NOTE_MANY)

    async def write_if_unchanged(self, writes: list[tuple[str, str, str]], *, fence: int) -> set[str]:
        """``(job id, the record as read, the record to write)`` in one round trip: each written only if the
        stored record is still the one read, none once leader ``fence`` is stale (StaleLeaderError). For changes
        without events or follow-ups (why a job waits). Returns the ids written."""
        if not writes:
            return set()
        assert all(Keys.job(j).startswith("ty:job:") for j, _, _ in writes)  # the script cuts the id at 8
        keys = [SchedulerKeys.leader_epoch, Keys.changes, *(Keys.job(j) for j, _, _ in writes)]
        args: list[str | int] = [fence, CHANGES_MAXLEN]
        for _, old, new in writes:
            args += [hashlib.sha1(old.encode()).hexdigest(), new]  # noqa: S324 - a comparison, not a secret
        written = [int(i) for i in await self._note_many(keys=keys, args=args)]
        if written == [-1]:
            raise StaleLeaderError(f"STALE_LEADER epoch {fence}")
        return {writes[i - 1][0] for i in written}

    async def apply(self, job_id: str, decide: Decide, *, need_checkpoints: bool = False, label: str = "update",
                    fence: int | None = None) -> tuple[JobRecord, tr.Outcome] | None:
        """(the record decided on, the outcome), written when it changed anything; None if the job is unknown.

        ``fence``: the leader epoch this write is made under (StaleLeaderError once another leader took over).
        """
        key, ckpt_key = Keys.job(job_id), Keys.checkpoints(job_id)
        watched = [key] + ([ckpt_key] if need_checkpoints else []) + ([SchedulerKeys.leader_epoch] if fence else [])
        for _ in range(_MAX_RACES):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(*watched)
                raw = await pipe.get(key)
                if raw is None:
                    return None
                if fence:
                    await self.check_epoch(pipe, fence)
                job = JobRecord.model_validate_json(raw)
                facts = checkpoint_facts(job, await pipe.hvals(ckpt_key)) if need_checkpoints else Facts()  # type: ignore[arg-type]  # decoded
                outcome = decide(job, facts)
                if not outcome.changed:
                    if outcome.note:
                        log.debug("job %s (%s): %s", job_id, label, outcome.note)
                    return job, outcome
                with job_span(job, f"scheduler.{label.replace(' ', '_')}"):
                    if not await self.try_execute(pipe, job_id, outcome):
                        continue  # lost the race: decide again on what is there now
            if outcome.note:
                log.info("job %s (%s): %s", job_id, label, outcome.note)
            return job, outcome
        raise ConflictError(f"job {job_id}: too many concurrent updates", retryable=True)

    async def check_epoch(self, pipe: Pipeline, epoch: int) -> None:
        """Inside a WATCH on the leader-epoch key: StaleLeaderError unless ``epoch`` is still current."""
        current: str | None = await pipe.get(SchedulerKeys.leader_epoch)  # type: ignore[assignment]  # decoded: str
        if int(current or 0) != epoch:
            raise StaleLeaderError(f"STALE_LEADER epoch {epoch}, current {current}")

    async def try_execute(self, pipe: Pipeline, job_id: str, outcome: tr.Outcome) -> bool:
        """Stage ``outcome`` and run the MULTI; False when a WATCHed key changed (lost the race: nothing written)."""
        self.stage(pipe, job_id, outcome)
        try:
            await pipe.execute()
        except WatchError:
            return False
        return True

    def stage(self, pipe: Pipeline, job_id: str, outcome: tr.Outcome) -> None:
        """Inside the caller's span: the record, its events (outbox) and the active-set entry."""
        pipe.multi()
        pipe.set(Keys.job(job_id), outcome.job.dumps())
        stage_change(pipe, "job", job_id)
        parent = current_traceparent() or outcome.job.traceparent
        for event in outcome.events:
            self.outbox.stage(pipe, event, traceparent=parent)
            if isinstance(event, ReplicaReplaced):  # the newcomer's grant, with the record that decided it
                pipe.set(Keys.replica(event.allocation_id, event.rank), event.generation, ex=REPLICA_GRANT_TTL_S)
        if outcome.job.state in TERMINAL_STATES:
            pipe.srem(SchedulerKeys.active, job_id)
        else:
            pipe.sadd(SchedulerKeys.active, job_id)
