"""The scheduler's picture of its nodes: inventory, drains, quarantine, reputation and stragglers (an I/O shell).

Which module decides, and what this writes:

- NodeHeartbeat → :meth:`NodeHealth.on_heartbeat`: the NodeRecord (``ty:nodes``), a drain the agent announced
  or ended (:func:`health.drain_change`), the node's device-lease TTLs; the snapshot re-reads nodes when
  something placement-relevant changed (:func:`_placement_changed`).
- NodeDrained / NodeUndrained (an admin) → ``ty:node-drain`` and the record's ``drained`` mirror.
- NodeQuarantined / NodeReinstated (an admin) → ``ty:node-quarantine``, the score reset.
- A failure blamed on a node (:meth:`NodeHealth.blame_node`, from a job transition's ``blame``) → the decaying
  score (:func:`health.add`) and, at the threshold and above the capacity floor (:func:`health.should_quarantine`,
  :func:`health.quarantine_floor`), a quarantine with NodeQuarantined staged in the same MULTI.
- StepMetrics → :class:`health.StragglerDetector` (pure, in memory) → StragglerDetected plus a blame.
- The leader's reconcile → :meth:`NodeHealth.reinstate_recovered` (:func:`health.should_reinstate`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import WatchError

from trainyard_contract.errors import ConflictError
from trainyard_contract.events import (
    NodeDrained,
    NodeHeartbeat,
    NodeQuarantined,
    NodeReinstated,
    NodeUndrained,
    StepMetrics,
    StragglerDetected,
)
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import NodeRecord
from trainyard_runtime.store import Keys, StateStore, note_change, stage_change

from trainyard_scheduler import health
from trainyard_scheduler import transitions as tr
from trainyard_scheduler.fencing import FencedLeases
from trainyard_scheduler.metrics import STRAGGLERS
from trainyard_scheduler.settings import SchedulerSettings
from trainyard_scheduler.snapshot import SnapshotCache

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
QUARANTINE_WITHHELD = Counter(
    "trainyard_scheduler_quarantine_withheld_total",
    "automatic quarantines not made because they would take too much of a device type's capacity (an alert)",
    ["device_type"])


def _placement_changed(previous: NodeRecord | None, record: NodeRecord) -> bool:
    """Whether a heartbeat changed what placement reads of a node (beyond its ``lastSeen``)."""
    fields = ("host", "rack", "nvlink_domain", "network_tier", "devices", "healthy", "boot_id", "sandbox")
    return previous is None or any(getattr(previous, f) != getattr(record, f) for f in fields)


def heartbeat_record(event: NodeHeartbeat, known: NodeRecord, seen: datetime, *,
                     quarantine: str | None | bool = False, drain: str | None | bool = False) -> NodeRecord:
    """The NodeRecord of ``event``; its quarantine and drain mirrors from their Redis entries when given
    (None: no entry), else as ``known`` says."""
    quarantined = known.quarantined if quarantine is False else json.loads(quarantine)["reason"] \
        if isinstance(quarantine, str) else None
    drained = known.drained if drain is False else json.loads(drain)["reason"] if isinstance(drain, str) else None
    return NodeRecord(
        node_id=event.node_id, host=event.host, rack=event.rack, nvlink_domain=event.nvlink_domain,
        network_tier=event.network_tier, devices=event.devices, healthy=event.healthy, last_seen=seen,
        quarantined=quarantined, drained=drained, boot_id=event.boot_id, sandbox=event.sandbox,
        warm_interpreters=event.warm_interpreters)


def fold_heartbeats(batch: list[NodeHeartbeat]) -> list[NodeHeartbeat]:
    """Of a batch, each node's latest heartbeat (the earlier ones say less), after any of its heartbeats that
    changed its state in the batch (draining, a new incarnation): those are not folded away."""
    out: list[NodeHeartbeat] = []
    latest: dict[str, NodeHeartbeat] = {}
    for event in batch:
        had = latest.get(event.node_id)
        if had is not None and (had.draining != event.draining or had.boot_id != event.boot_id):
            out.append(had)
        if had is None or had.occurred_at <= event.occurred_at:
            latest[event.node_id] = event
    return out + list(latest.values())


class RoutineHeartbeats:
    """Writes routine heartbeats together: their quarantine and drain read in one pipeline, the records written
    and the devices' leases renewed in another (``known``: each node's record as this instance last wrote it)."""

    def __init__(self, redis: Redis, leases: FencedLeases, cache: SnapshotCache, known: dict[str, NodeRecord], *,
                 clock: Clock) -> None:
        self.redis, self.leases, self.cache, self.known, self.clock = redis, leases, cache, known, clock

    async def flush(self, pending: dict[str, NodeHeartbeat]) -> None:
        if not pending:
            return
        ids = list(pending)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(Keys.node_quarantine, ids)
            pipe.hmget(Keys.node_drain, ids)
            quarantines, drains = await pipe.execute()
        now = self.clock()
        records: dict[str, NodeRecord] = {}
        for node_id, quarantine, drain in zip(ids, quarantines, drains, strict=True):
            event, known = pending[node_id], self.known.get(node_id)
            seen = min(event.occurred_at, now)
            if known is None or known.last_seen > seen:
                continue
            records[node_id] = heartbeat_record(event, known, seen, quarantine=quarantine, drain=drain)
        if not records:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(Keys.nodes, mapping={k: r.dumps() for k, r in records.items()})
            for node_id, record in records.items():
                await self.leases.stage_renew_node(pipe, node_id, [d.index for d in record.devices])
            await pipe.execute()
        for record in records.values():
            self.known[record.node_id] = record
            self.cache.note_node(record)


class NodeHealth:
    """Handlers and queries for nodes; every write is a fact any scheduler instance may apply."""

    def __init__(self, redis: Redis, store: StateStore, outbox: Outbox, leases: FencedLeases, cache: SnapshotCache,
                 settings: SchedulerSettings, *, clock: Clock, recent_s: float,
                 wake_at: Callable[[datetime | None], None]) -> None:
        self.redis, self.store, self.outbox, self.cache = redis, store, outbox, cache
        self.settings, self.clock, self.recent_s = settings, clock, recent_s
        self._leases, self._wake_at = leases, wake_at
        self._known: dict[str, NodeRecord] = {}  # node id -> its record as this instance last wrote it
        self._pending: dict[str, NodeHeartbeat] = {}  # routine heartbeats not yet written (flush_heartbeats)
        self.routine = RoutineHeartbeats(redis, leases, cache, self._known, clock=clock)
        self.reputation = health.ReputationPolicy(half_life_s=settings.reputation_half_life_s,
                                                  quarantine_at=settings.quarantine_score,
                                                  reinstate_below=settings.reinstate_score,
                                                  per_tenant_cap=settings.reputation_per_tenant_cap)
        self.stragglers = health.StragglerDetector(health.StragglerPolicy(
            window_steps=settings.straggler_window_steps, factor=settings.straggler_factor,
            consecutive=settings.straggler_windows))

    # ------------------------------------------------------------------ inventory
    async def on_heartbeats(self, batch: list[NodeHeartbeat]) -> None:
        """A fetched batch, folded (:func:`fold_heartbeats`), each as :meth:`on_heartbeat`."""
        for event in fold_heartbeats(batch):
            await self.on_heartbeat(event)

    async def on_heartbeat(self, event: NodeHeartbeat) -> None:
        """A routine heartbeat (the node as this instance last stored it, but for its time and running
        allocations) is kept for :meth:`flush_heartbeats`, which writes every node's latest in two round trips;
        anything else — a node not seen yet by this instance, a drain, a new incarnation, a change placement
        reads — is applied at once (:meth:`apply_heartbeat`). A heartbeat is the node's state, not a fact: one
        lost in a crash before its flush is replaced by the next one, seconds later."""
        known = self._known.get(event.node_id)
        if known is None or event.draining or event.boot_id != known.boot_id or \
                _placement_changed(known, heartbeat_record(event, known, known.last_seen)):
            await self.apply_heartbeat(event)
            return
        waiting = self._pending.get(event.node_id)
        if waiting is None or waiting.occurred_at <= event.occurred_at:
            self._pending[event.node_id] = event

    async def flush_heartbeats(self) -> None:
        """Write the routine heartbeats kept since the last flush (:meth:`RoutineHeartbeats.flush`)."""
        pending, self._pending = self._pending, {}
        await self.routine.flush(pending)

    async def apply_heartbeat(self, event: NodeHeartbeat) -> None:
        """A heartbeat applied at once: the record (with its quarantine and drain), a drain started or ended,
        the snapshot told when placement must re-read the node, the devices' leases renewed."""
        self._pending.pop(event.node_id, None)
        seen = min(event.occurred_at, self.clock())
        raw = await self.redis.hget(Keys.nodes, event.node_id)
        previous = NodeRecord.model_validate_json(raw) if raw else None
        if previous and previous.last_seen > seen:
            return  # an older heartbeat delivered late
        quarantine = await self.redis.hget(Keys.node_quarantine, event.node_id)
        drain = await self._maybe_change_drain(event, previous)
        record = NodeRecord(
            node_id=event.node_id, host=event.host, rack=event.rack, nvlink_domain=event.nvlink_domain,
            network_tier=event.network_tier, devices=event.devices, healthy=event.healthy, last_seen=seen,
            quarantined=json.loads(quarantine)["reason"] if quarantine else None,
            drained=drain["reason"] if drain else None, boot_id=event.boot_id, sandbox=event.sandbox,
            warm_interpreters=event.warm_interpreters,
        )
        await self.store.put_node(record)
        if _placement_changed(previous, record):
            await self._node_changed(event.node_id)
        self._known[event.node_id] = record
        self.cache.note_node(record)
        await self._leases.renew_node(event.node_id, [d.index for d in event.devices])

    async def _maybe_change_drain(self, event: NodeHeartbeat, previous: NodeRecord | None) -> dict | None:
        """A heartbeat saying ``draining`` drains the node (its agent is stopping); one from a new incarnation
        of its agent ends any drain (the node restarted). Returns the drain in force."""
        raw = await self.redis.hget(Keys.node_drain, event.node_id)
        entry = json.loads(raw) if raw else None
        change = health.drain_change(entry, draining=event.draining, boot_id=event.boot_id,
                                     previous_boot_id=previous.boot_id if previous else None)
        if change == "start":
            entry = {"reason": f"its node agent is stopping ({event.host})", "by": "node-agent",
                     "at": self.clock().isoformat(), "bootId": event.boot_id}
            await self.redis.hset(Keys.node_drain, event.node_id, json.dumps(entry))
            await self._node_changed(event.node_id)
            log.warning("node %s drained: %s", event.node_id, entry["reason"])
            self._wake_at(None)
        elif change == "end":
            await self.redis.hdel(Keys.node_drain, event.node_id)
            await self._node_changed(event.node_id)
            log.warning("node %s undrained: its node agent restarted", event.node_id)
            self._wake_at(None)
            return None
        return entry

    async def on_drained(self, event: NodeDrained) -> None:
        """An admin's drain (or a Kubernetes node drain): no new work there; its attempts checkpoint and stop."""
        raw = await self.redis.hget(Keys.nodes, event.node_id)
        node = NodeRecord.model_validate_json(raw) if raw else None
        entry = {"reason": event.reason, "by": event.by or "admin", "at": event.occurred_at.isoformat(),
                 "bootId": node.boot_id if node else None}
        await self.redis.hset(Keys.node_drain, event.node_id, json.dumps(entry))
        await self._node_changed(event.node_id)
        await self._show_drain(event.node_id, event.reason)
        log.warning("node %s drained by %s: %s", event.node_id, event.by or "admin", event.reason)
        self._wake_at(None)

    async def on_undrained(self, event: NodeUndrained) -> None:
        await self.redis.hdel(Keys.node_drain, event.node_id)
        await self._node_changed(event.node_id)
        await self._show_drain(event.node_id, None)
        log.warning("node %s undrained by %s: %s", event.node_id, event.by or "admin", event.reason)
        self._wake_at(None)

    async def _node_changed(self, node_id: str) -> None:
        """Something placement-relevant about the node changed: the leader's snapshot re-reads the nodes."""
        self.cache.nodes_changed()
        await note_change(self.redis, "node", node_id)

    async def _show_drain(self, node_id: str, reason: str | None) -> None:
        await self._mirror_on_node(node_id, "drained", reason)

    async def _mirror_on_node(self, node_id: str, field: str, reason: str | None) -> None:
        """Mirror a drain or quarantine into the NodeRecord (what GET /nodes shows); placement reads its own key."""
        raw = await self.redis.hget(Keys.nodes, node_id)
        if raw:
            record = NodeRecord.model_validate_json(raw)
            if getattr(record, field) != reason:
                setattr(record, field, reason)
                await self.store.put_node(record)

    async def on_quarantined(self, event: NodeQuarantined) -> None:
        """An admin's quarantine is recorded; the reputation's own was written before it was published."""
        if event.by != "reputation":
            await self.redis.hset(Keys.node_quarantine, event.node_id, json.dumps(health.quarantine_entry(event)))
            await self._node_changed(event.node_id)
        await self._show_quarantine(event.node_id, event.reason)
        log.warning("node %s quarantined by %s: %s", event.node_id, event.by or "admin", event.reason)

    async def on_reinstated(self, event: NodeReinstated) -> None:
        """An admin's clear (``by`` not "reputation") ends any quarantine and resets the node's score."""
        if event.by == "reputation":
            return  # written before it was published
        await self.clear_quarantine(event.node_id, by=event.by or "admin", reason=event.reason, publish=False)

    async def clear_quarantine(self, node_id: str, *, by: str, reason: str, publish: bool = True) -> bool:
        """Admin clear: the node is placeable again and its score starts from zero; False if it was not quarantined.

        ``publish``: also publish NodeReinstated (not when called for one).
        """
        was = await self.redis.hget(Keys.node_quarantine, node_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.multi()
            pipe.hdel(Keys.node_quarantine, node_id)
            pipe.hdel(Keys.node_reputation, node_id)
            stage_change(pipe, "node", node_id)
            if publish:
                self.outbox.stage(pipe, NodeReinstated(node_id=node_id, reason=reason, by=by))
            await pipe.execute()
        await self._show_quarantine(node_id, None)
        log.warning("node %s reinstated by %s: %s", node_id, by, reason)
        return was is not None

    async def _show_quarantine(self, node_id: str, reason: str | None) -> None:
        await self._mirror_on_node(node_id, "quarantined", reason)

    async def blame_node(self, node_id: str, reason: str, weight: float, *, tenant: str | None = None,
                         events: tuple[StragglerDetected, ...] = ()) -> float:
        """Add ``weight`` to the node's decaying score (with ``events`` in the same MULTI) — what a ``tenant``'s
        rank reported only up to that tenant's cap (:func:`health.add`); quarantine it at the threshold. Returns
        the new score."""
        now = self.clock()
        for _ in range(50):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(Keys.node_reputation, Keys.node_quarantine)
                raw = await pipe.hget(Keys.node_reputation, node_id)
                quarantined = await pipe.hget(Keys.node_quarantine, node_id) is not None
                score = health.add(health.NodeScore.from_dict(json.loads(raw)) if raw else None, weight, now,
                                   self.reputation, tenant)
                staged: list = list(events)
                pipe.multi()
                pipe.hset(Keys.node_reputation, node_id, json.dumps(score.to_dict()))
                stage_change(pipe, "node", node_id)
                quarantine = health.should_quarantine(score.score, quarantined, self.reputation)
                withheld = await self._quarantine_withheld(node_id) if quarantine else None
                quarantine = quarantine and withheld is None
                if quarantine:
                    until = health.quarantine_until(score.score, now, self.reputation)
                    why = (f"failure score {score.score:.2f} reached {self.reputation.quarantine_at:g} "
                           f"(latest: {reason})")
                    event = NodeQuarantined(node_id=node_id, reason=why, score=round(score.score, 3),
                                            until=until, by="reputation", occurred_at=now)
                    pipe.hset(Keys.node_quarantine, node_id, json.dumps(health.quarantine_entry(event)))
                    staged.append(event)
                for event in staged:
                    self.outbox.stage(pipe, event)
                try:
                    await pipe.execute()
                except WatchError:
                    continue
            if quarantine:
                await self._show_quarantine(node_id, why)
                log.warning("node %s quarantined: %s", node_id, why)
            elif withheld is not None:
                kind, detail = withheld
                QUARANTINE_WITHHELD.labels(kind).inc()
                log.error("ALERT: node %s reached failure score %.2f (latest: %s) but is not quarantined "
                          "automatically: %s. Look at the node; quarantine it by hand if it is faulty "
                          "(NodeQuarantined with by=<your name>)", node_id, score.score, reason, detail)
            return score.score
        raise ConflictError(f"node {node_id}: too many concurrent score updates", retryable=True)

    async def _quarantine_withheld(self, node_id: str) -> tuple[str, str] | None:
        """(device type, why) when quarantining ``node_id`` would cross the floor (health.quarantine_floor)."""
        horizon = self.clock() - timedelta(seconds=self.recent_s)
        capacity: dict[str, dict[str, int]] = {}
        for node in await self.store.list_nodes():
            if node.last_seen >= horizon or node.node_id == node_id:
                kinds: dict[str, int] = {}
                for d in node.devices:
                    kinds[d.type] = kinds.get(d.type, 0) + 1
                capacity[node.node_id] = kinds
        # drained nodes are out of service too: what a quarantine may take is what is left
        quarantined, drained = await self.redis.hkeys(Keys.node_quarantine), await self.redis.hkeys(Keys.node_drain)
        out: set[str] = (set(quarantined) | set(drained)) - {node_id}  # type: ignore[assignment]  # decoded: str
        why = health.quarantine_floor(node_id, capacity=capacity, out=out, max_share=self.settings.quarantine_max_share)
        if why is None:
            return None
        kind = next(iter(sorted(capacity.get(node_id, {"unknown": 0}))))
        return kind, why

    async def reinstate_recovered(self, now: datetime) -> None:
        """Quarantines of the reputation whose score decayed under ``reinstate_score`` end (leader only)."""
        entries: dict[str, str] = await self.redis.hgetall(Keys.node_quarantine)  # type: ignore[assignment]  # decoded: str
        for node_id, raw in entries.items():
            entry = json.loads(raw)
            score_raw = await self.redis.hget(Keys.node_reputation, node_id)
            score = health.decayed(health.NodeScore.from_dict(json.loads(score_raw)) if score_raw else None,
                                   now, self.reputation)
            if not health.should_reinstate(score, entry.get("by"), self.reputation):
                continue
            why = f"failure score decayed to {score:.2f}, under {self.reputation.reinstate_below:g}"
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(Keys.node_quarantine)
                if await pipe.hget(Keys.node_quarantine, node_id) != raw:
                    continue
                pipe.multi()
                pipe.hdel(Keys.node_quarantine, node_id)
                stage_change(pipe, "node", node_id)
                self.outbox.stage(pipe, NodeReinstated(node_id=node_id, reason=why, by="reputation"))
                try:
                    await pipe.execute()
                except WatchError:
                    continue
            await self._show_quarantine(node_id, None)
            log.info("node %s reinstated: %s", node_id, why)

    async def available_nodes(self, now: datetime, *, include_quarantined: bool = False) -> list[NodeRecord]:
        """Nodes that heart-beat within ``node_timeout_s``, are healthy and (unless asked) neither quarantined
        nor drained."""
        live = health.live_nodes(await self.store.list_nodes(), now, self.settings.node_timeout_s)
        if include_quarantined:
            return live
        quarantined: list[str] = await self.redis.hkeys(Keys.node_quarantine)  # type: ignore[assignment]  # decoded: str
        drained: list[str] = await self.redis.hkeys(Keys.node_drain)  # type: ignore[assignment]  # decoded: str
        return health.placeable_nodes(live, quarantined=set(quarantined), drained=set(drained))

    async def node_penalties(self, nodes: list[NodeRecord]) -> dict[str, float]:
        """Each node's decayed failure score: higher = used last among equal choices."""
        raw: dict[str, str] = await self.redis.hgetall(Keys.node_reputation)  # type: ignore[assignment]  # decoded: str
        return health.penalties({n: json.loads(v) for n, v in raw.items()}, self.clock(), self.reputation)

    # ------------------------------------------------------------------ stragglers
    async def on_step_metrics_batch(self, batch: list[StepMetrics]) -> None:
        for event in batch:
            await self.on_step_metrics(event)

    async def on_step_metrics(self, event: StepMetrics) -> None:
        for found in self.stragglers.observe(event.job_id, event.attempt, event.rank, event.step,
                                             event.compute_seconds):
            await self._report_straggler(found)

    async def _report_straggler(self, found: health.Straggler) -> None:
        job = await self.store.get_job(found.job_id)
        attempt = next((a for a in job.attempts if a.attempt == found.attempt), None) if job else None
        node_id = tr.rank_nodes(attempt).get(found.rank) if attempt else None
        if node_id is None:
            log.warning("straggler rank %d of %s attempt %d: its node is unknown; not reported", found.rank,
                        found.job_id, found.attempt)
            return
        event = StragglerDetected(
            job_id=found.job_id, attempt=found.attempt, rank=found.rank, node_id=node_id, slowdown=found.slowdown,
            compute_seconds=found.compute_seconds, median_compute_seconds=found.median_compute_seconds,
            window_steps=found.window_steps, from_step=found.from_step, to_step=found.to_step)
        score = await self.blame_node(node_id, "straggler", self.reputation.straggler_weight, events=(event,),
                                      tenant=job.tenant if job else None)
        STRAGGLERS.inc()
        log.warning("job %s attempt %d: rank %d on %s is a straggler (%.2fx the median rank over steps %d-%d); "
                    "node score %.2f", found.job_id, found.attempt, found.rank, node_id, found.slowdown,
                    found.from_step, found.to_step, score)
