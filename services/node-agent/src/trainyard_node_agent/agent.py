"""The node agent: heartbeats this node's inventory, launches the ranks a GangAllocated
assigns to it, relays their event spools, reports their exits, and stops them when the
allocation is revoked or the agent itself stops.

Fencing: an allocation is launched only if its epoch is not older than the highest this
node has seen for the job (kept in Redis, so it survives restarts) and every device it
names is leased to it right now; each allocation id is launched at most once.

Order: a rank's spool is drained completely before its WorkerExited is staged, so a
final ShardWritten or StepMetrics never arrives after the exit that follows it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import shutil
import signal
import time
import uuid
from collections.abc import Mapping
from typing import Any

from trainyard_common.events import (
    ALL_TOPICS,
    ALLOCATIONS,
    AllocationRevoked,
    DeadLetter,
    DeviceInfo,
    GangAllocated,
    NodeHeartbeat,
    WorkerExited,
    WorkerStarted,
)
from trainyard_common.exitcodes import exit_reason
from trainyard_common.service import ServiceRuntime
from trainyard_common.spool import SpoolReader
from trainyard_common.storage import ArtifactLayout, atomic_write_bytes, path_to_uri
from trainyard_common.store import Keys
from trainyard_common.tracing import current_traceparent

from trainyard_node_agent import ranks as rp
from trainyard_node_agent.admission import Launch, Refuse, judge, pick_backend, rank_env
from trainyard_node_agent.settings import NodeAgentSettings

log = logging.getLogger(__name__)
_REFUSALS_KEPT = 100


class AgentKeys:
    """Redis keys a node agent owns, per node."""

    def __init__(self, node_id: str) -> None:
        base = f"ty:agent:{node_id}"
        self.epochs = f"{base}:epochs"  # job id -> highest epoch seen
        self.launched = f"{base}:launched"  # allocation ids ever launched here
        self.ranks = f"{base}:ranks"  # "<allocation>/<rank>" -> RankProcess.persisted()
        self.refused = f"{base}:refused"  # recent refusals, newest first (JSON)


class NodeAgent:
    """Wires the handlers and the heartbeat onto a :class:`ServiceRuntime`."""

    def __init__(self, runtime: ServiceRuntime, settings: NodeAgentSettings, *,
                 base_env: Mapping[str, str]) -> None:
        self.runtime = runtime
        self.settings = settings
        self.redis = runtime.redis
        self.keys = AgentKeys(settings.node_id)
        self.layout = ArtifactLayout(settings.artifact_root)
        self.base_env = dict(base_env)
        self.backend = pick_backend(settings.backend, settings.device_type,
                                    has_nvidia_smi=shutil.which("nvidia-smi") is not None)
        self.group = f"{settings.group_prefix}.node-agent.{settings.node_id}"
        self.boot_id = uuid.uuid4().hex
        self.ranks: dict[str, rp.RankProcess] = {}
        self._seq = 0
        self._closing = False
        self._background: set[asyncio.Task[None]] = set()
        self._leftovers: dict[str, dict[str, Any]] = {}

    def install(self) -> None:
        """Subscribe (a group of its own: every agent sees every allocation) and heartbeat."""
        self.runtime.bus.subscribe(
            ALLOCATIONS,
            {GangAllocated: self.on_gang_allocated, AllocationRevoked: self.on_allocation_revoked},
            group=self.group, deduper_factory=self.runtime.deduper,
        )
        self.runtime.add_loop("heartbeat", self.heartbeat, self.settings.heartbeat_s)

    async def prepare(self) -> None:
        """Before ``runtime.start()``: kill the ranks an earlier incarnation of this agent left
        running, so they never overlap with ranks launched for new allocations."""
        self._leftovers = await self._kill_leftovers()

    async def start(self) -> None:
        """After ``runtime.start()``: relay the leftovers' spools and report them lost."""
        for key, entry in self._leftovers.items():
            await self._report_leftover(key, entry)
        self._leftovers = {}

    async def aclose(self) -> None:
        """Stop every rank (SIGTERM, then SIGKILL after the grace), report the exits, flush."""
        if self._closing:
            return
        self._closing = True
        try:  # tell the scheduler first, so nothing new is placed here
            await self.heartbeat()
        except Exception as exc:  # noqa: BLE001 - best effort; the heartbeat timeout says the same
            log.warning("could not send the final heartbeat: %r", exc)
        live = [r for r in self.ranks.values() if r.running]
        for rank in live:
            rank.stop_detail = rank.stop_detail or "the node agent stopped"
        if live:
            log.info("stopping %d rank(s) before shutdown", len(live))
        await asyncio.gather(*(rp.stop(r, self.settings.kill_grace_s) for r in live))
        watchers = [r.watcher for r in list(self.ranks.values()) if r.watcher]
        if watchers:
            await asyncio.wait(watchers, timeout=15.0)
        for task in self._background:
            task.cancel()
        await self._flush_outbox(timeout_s=5.0)
        log.info("node agent %s stopped", self.settings.node_id)

    # ------------------------------------------------------------------ heartbeat
    def heartbeat_event(self) -> NodeHeartbeat:
        s = self.settings
        self._seq += 1
        return NodeHeartbeat(
            node_id=s.node_id, host=s.host, rack=s.rack, nvlink_domain=s.nvlink_domain,
            devices=[DeviceInfo(index=i, type=s.device_type, memory_bytes=s.device_memory_bytes)
                     for i in range(s.device_count)],
            running_allocations=sorted({r.allocation_id for r in self.ranks.values() if r.running}),
            healthy=not self._closing,
            seq=self._seq,
        )

    async def heartbeat(self) -> None:
        await self.runtime.bus.publish(self.heartbeat_event())

    # ------------------------------------------------------------------ allocations
    async def on_gang_allocated(self, event: GangAllocated) -> None:
        node = self.settings.node_id
        share = next((n for n in event.nodes if n.node_id == node), None)
        if share is None:
            return
        if self._closing:
            # Our last heartbeat said "unhealthy": the scheduler fails this attempt as lost and
            # places it elsewhere; holding the message would only delay the shutdown.
            log.warning("not launching allocation %s: the node agent is stopping", event.allocation_id)
            return
        raw_epoch = await self.redis.hget(self.keys.epochs, event.job_id)
        holders = await self._lease_holders([s.device_index for s in share.ranks])
        decision = judge(event, node, highest_epoch=int(raw_epoch) if raw_epoch else None, lease_holders=holders)
        if isinstance(decision, Refuse):
            await self._refuse(event, decision.reason)
            return
        assert isinstance(decision, Launch)
        if not await self.redis.sadd(self.keys.launched, event.allocation_id):
            log.info("allocation %s was launched here before; not launching it again", event.allocation_id)
            return
        if raw_epoch is None or event.epoch > int(raw_epoch):
            await self.redis.hset(self.keys.epochs, event.job_id, event.epoch)
        await self._launch(event, decision)

    async def on_allocation_revoked(self, event: AllocationRevoked) -> None:
        targets = [r for r in self.ranks.values() if r.allocation_id == event.allocation_id]
        if not targets:
            return
        if event.epoch < targets[0].epoch:
            log.warning("ignoring revocation of %s with stale epoch %d < %d", event.allocation_id,
                        event.epoch, targets[0].epoch)
            return
        log.info("revoking allocation %s (%s): stopping %d rank(s)", event.allocation_id, event.reason,
                 sum(r.running for r in targets))
        for rank in targets:
            rank.revoked = True
            rank.stop_detail = event.reason
            if rank.running:
                self._in_background(rp.stop(rank, self.settings.kill_grace_s))

    async def _lease_holders(self, indices: list[int]) -> dict[int, dict[str, Any] | None]:
        keys = [Keys.lease(self.settings.node_id, i) for i in indices]
        raws = await self.redis.mget(keys) if keys else []
        return {i: (json.loads(raw) if raw else None) for i, raw in zip(indices, raws, strict=True)}

    async def _refuse(self, event: GangAllocated, reason: str) -> None:
        log.warning("refusing allocation %s of job %s (epoch %d): %s", event.allocation_id, event.job_id,
                    event.epoch, reason)
        entry = json.dumps({"allocationId": event.allocation_id, "jobId": event.job_id, "epoch": event.epoch,
                            "attempt": event.attempt, "reason": reason, "at": time.time()})
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lpush(self.keys.refused, entry)
            pipe.ltrim(self.keys.refused, 0, _REFUSALS_KEPT - 1)
            await pipe.execute()

    async def _launch(self, event: GangAllocated, decision: Launch) -> None:
        share = decision.share
        traceparent = current_traceparent()
        attempt_dir = self.layout.attempt_dir(event.tenant, event.job_id, event.attempt)
        allocation_file = attempt_dir / f"allocation.{self.settings.node_id}.json"
        atomic_write_bytes(allocation_file, event.to_bytes())
        for slot in share.ranks:
            log_path = self.layout.rank_log(event.tenant, event.job_id, event.attempt, slot.rank)
            events_file = self.layout.rank_events(event.tenant, event.job_id, event.attempt, slot.rank)
            events_file.parent.mkdir(parents=True, exist_ok=True)
            env = rank_env(
                event, share, slot, base_env=self.base_env, backend=self.backend,
                artifact_root=self.layout.root, allocation_file=allocation_file, events_file=events_file,
                traceparent=traceparent, cpu_threads=1 if self.settings.device_type == "cpu" else None,
                extra=self.settings.rank_env,
            )
            rank = rp.RankProcess(
                job_id=event.job_id, tenant=event.tenant, attempt=event.attempt,
                allocation_id=event.allocation_id, epoch=event.epoch, rank=slot.rank, local_rank=slot.local_rank,
                pid=0, log_path=log_path, spool=SpoolReader(events_file), traceparent=traceparent,
            )
            try:
                rank.process = await rp.spawn(self.settings.rank_command, env, log_path)
            except OSError as exc:
                log.error("cannot start rank %d of %s: %r", slot.rank, event.allocation_id, exc)
                await self._report_exit(rank, 127, "error", f"cannot start {self.settings.rank_command[0]}: {exc}")
                continue
            rank.pid = rank.process.pid
            self.ranks[rank.key] = rank
            await self.redis.hset(self.keys.ranks, rank.key, json.dumps(rank.persisted(self.boot_id)))
            await self.runtime.outbox.put(
                WorkerStarted(job_id=event.job_id, attempt=event.attempt, allocation_id=event.allocation_id,
                              epoch=event.epoch, node_id=self.settings.node_id, rank=slot.rank, pid=rank.pid,
                              log_uri=path_to_uri(log_path)),
                traceparent=traceparent,
            )
            rank.watcher = asyncio.create_task(self._watch(rank), name=f"rank-{rank.key}")
        log.info("launched ranks %s of job %s attempt %d (allocation %s, epoch %d, backend %s)",
                 [s.rank for s in share.ranks], event.job_id, event.attempt, event.allocation_id,
                 event.epoch, self.backend)

    # ------------------------------------------------------------------ watching ranks
    async def _watch(self, rank: rp.RankProcess) -> None:
        """Relay the spool while the rank runs; after it exits, drain it, then report the exit."""
        assert rank.process is not None
        try:
            while True:
                exited = await rp.wait_exited(rank.process, self.settings.spool_poll_s)
                await self._relay(rank, quiet=True)
                if exited:
                    break
            await self._drain(rank)
            code = rank.process.returncode
            assert code is not None
            reason = "revoked" if rank.revoked else exit_reason(code)
            await self._report_exit(rank, code, reason, rank.stop_detail)
            await self.redis.hdel(self.keys.ranks, rank.key)
        except Exception:  # noqa: BLE001 - a watcher must not vanish silently
            log.exception("watching rank %s failed", rank.key)
        finally:
            self.ranks.pop(rank.key, None)

    async def _relay(self, rank: rp.RankProcess, *, quiet: bool = False) -> int:
        """Publish the spool lines written since the last call; returns how many."""
        published = 0
        try:
            for offset, record in rank.spool.read_new():
                await self._publish_spooled(rank, offset, record)
                rank.spool.offset = offset
                published += 1
        except Exception as exc:
            if not quiet:
                raise
            log.warning("relaying the spool of rank %s: %r (retrying)", rank.key, exc)
        if published:
            await self.redis.hset(self.keys.ranks, rank.key, json.dumps(rank.persisted(self.boot_id)))
        return published

    async def _publish_spooled(self, rank: rp.RankProcess, offset: int, record: dict[str, Any]) -> None:
        topic, payload = record.get("topic"), record.get("payload")
        if "corrupt" in record or topic not in ALL_TOPICS or not isinstance(payload, dict):
            raw = record.get("corrupt") or json.dumps(record)
            await self.runtime.bus.publish(DeadLetter(
                source_topic=f"spool:{rank.spool.path}", partition=rank.rank, offset=offset,
                consumer_group=self.group, raw_b64=base64.b64encode(str(raw).encode()).decode(),
                error="unreadable spool line" if "corrupt" in record else f"spool line for unknown topic {topic!r}",
            ), traceparent=rank.traceparent)
            return
        await self.runtime.bus.publish_raw_traced(
            topic, json.dumps(payload, separators=(",", ":")).encode(), key=record.get("key"),
            traceparent=record.get("traceparent") or rank.traceparent,
        )

    async def _drain(self, rank: rp.RankProcess) -> None:
        """Relay until the spool is empty; retry while the broker is away (bounded when closing)."""
        delay, deadline = 0.2, None
        while True:
            try:
                while await self._relay(rank):
                    pass
                return
            except Exception as exc:  # noqa: BLE001 - infrastructure trouble: wait and retry
                if self._closing:
                    deadline = deadline or time.monotonic() + 10.0
                    if time.monotonic() > deadline:
                        log.error("giving up draining the spool of %s at offset %d: %r", rank.key,
                                  rank.spool.offset, exc)
                        return
                log.warning("draining the spool of %s failed: %r; retry in %.1fs", rank.key, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _report_exit(self, rank: rp.RankProcess, code: int, reason: str, detail: str | None) -> None:
        event = WorkerExited(
            job_id=rank.job_id, attempt=rank.attempt, allocation_id=rank.allocation_id, epoch=rank.epoch,
            node_id=self.settings.node_id, rank=rank.rank, exit_code=code, reason=reason, detail=detail,
        )
        delay = 0.2
        while True:
            try:
                await self.runtime.outbox.put(event, traceparent=rank.traceparent)
                break
            except Exception as exc:  # noqa: BLE001 - Redis away: the exit must still be reported
                if self._closing and delay >= 5.0:
                    log.error("could not record the exit of %s: %r", rank.key, exc)
                    return
                log.warning("recording the exit of %s failed: %r; retry in %.1fs", rank.key, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        log.info("rank %d of %s exited with %d (%s)", rank.rank, rank.allocation_id, code, reason)

    # ------------------------------------------------------------------ restarts
    async def _kill_leftovers(self) -> dict[str, dict[str, Any]]:
        """SIGKILL the process groups of ranks recorded by an earlier incarnation; returns their records."""
        leftovers: dict[str, dict[str, Any]] = {}
        for key, raw in (await self.redis.hgetall(self.keys.ranks)).items():
            entry = json.loads(raw)
            if entry.get("boot") == self.boot_id:
                continue
            leftovers[key] = entry
            pid, pgid = int(entry["pid"]), int(entry["pgid"])
            if rp.alive(pid, pgid):
                log.warning("stopping rank %s (pid %d) left behind by an earlier agent", key, pid)
                rp.signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(rp.alive(int(e["pid"]), int(e["pgid"])) for e in leftovers.values()):
            await asyncio.sleep(0.05)
        return leftovers

    async def _report_leftover(self, key: str, entry: dict[str, Any]) -> None:
        tenant, job_id, attempt, rank_no = entry["tenant"], entry["jobId"], int(entry["attempt"]), int(entry["rank"])
        rank = rp.RankProcess(
            job_id=job_id, tenant=tenant, attempt=attempt, allocation_id=entry["allocationId"],
            epoch=int(entry["epoch"]), rank=rank_no, local_rank=0, pid=int(entry["pid"]),
            log_path=self.layout.rank_log(tenant, job_id, attempt, rank_no),
            spool=SpoolReader(entry["spool"], int(entry.get("offset", 0))), traceparent=entry.get("traceparent"),
        )
        await self._drain(rank)
        await self._report_exit(rank, -9, "lost", "the node agent restarted; the rank it left behind was stopped")
        await self.redis.hdel(self.keys.ranks, key)

    # ------------------------------------------------------------------ helpers
    def _in_background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _flush_outbox(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if await self.runtime.outbox.pending() == 0:
                    return
                await self.runtime.outbox.relay_once(self.runtime.bus)
            except Exception as exc:  # noqa: BLE001 - best effort; the outbox is durable
                log.warning("flushing the outbox before shutdown: %r", exc)
                await asyncio.sleep(0.5)
