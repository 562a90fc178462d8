"""Simulated nodes on the real bus: one process stands in for many node agents.

    python bench/cluster_scale/simnodes.py --bootstrap HOST:PORT --redis-url URL --nodes 4096 [--first 0]
           [--count N] [--heartbeat-s 2] [--step-hz 1] [--namespace NS] [--artifacts DIR --checkpoint-every 100]

What each simulated node does is what a node agent does on the wire, through the same topics and the same
event classes (the contract), so the live scheduler, API, telemetry, coordinator and registry cannot tell:

* it heartbeats (NodeHeartbeat every ``--heartbeat-s``, spread over the interval) with the topology of
  :class:`trainyard_scheduler.simulation.ClusterShape`: 8 devices a node, an NVLink domain a node, 32 nodes a
  rack, 8 racks a network tier, ``h100-80gb`` devices (the scheduler's own simulator's cluster);
* it reads every GangAllocated (a consumer group of its own, as every agent does) and starts its ranks of it:
  a WorkerStarted per rank, no process;
* its ranks report StepMetrics at ``--step-hz`` steps a second each (every rank, as the SDK does), until
  the allocation is revoked (AllocationRevoked: a WorkerExited ``revoked`` per rank), or as the job's name
  says: ``…-fail-…`` fails its rank 0 (WorkerExited ``error``) after ``--fail-after-s``, ``…-hang-…`` starts
  and never reports a step.

No rank runs and no shard is written: the figures are the control plane's. The process prints ``ready
<nodes>`` once its consumer is positioned and every node has heartbeat once, then one line of counters a
second as JSON (``{"heartbeats":…, "started":…, "steps":…, "exited":…, "lagS":…}``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from redis.asyncio import Redis

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "services" / "scheduler" / "src"))

from trainyard_contract.events import (  # noqa: E402 - after the sys.path set-up
    ALLOCATIONS,
    METRICS,
    NODES,
    CHECKPOINTS,
    WORKERS,
    DeviceInfo,
    FileDigest,
    NodeHeartbeat,
    ShardWritten,
    StepMetrics,
    WorkerExited,
    WorkerStarted,
)
from trainyard_contract.storage import ArtifactLayout, location_uri  # noqa: E402
from trainyard_runtime.idlefetch import Doorbell  # noqa: E402
from trainyard_scheduler.simulation import ClusterShape  # noqa: E402

HEADERS = [("content-type", b"application/json")]
FETCH_MAX_WAIT_MS = 20  # the stack's own hot consumers' wait (trainyard_cli.stack.EMBEDDED_FETCH_MAX_WAIT_MS)


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class SimRank:
    job_id: str
    tenant: str
    attempt: int
    allocation_id: str
    epoch: int
    node_id: str
    rank: int
    behaviour: str  # run | fail | hang
    started: float
    world_size: int = 1
    step: int = 0
    saved_step: int | None = None


@dataclass
class Counters:
    heartbeats: int = 0
    started: int = 0
    steps: int = 0
    exited: int = 0
    allocations: int = 0
    shards: int = 0
    lag_s: float = 0.0  # how far the heartbeat loop ran behind its schedule at its worst, last interval

    def line(self) -> str:
        return json.dumps({"heartbeats": self.heartbeats, "started": self.started, "steps": self.steps,
                           "exited": self.exited, "allocations": self.allocations, "shards": self.shards,
                           "lagS": round(self.lag_s, 3)})


def behaviour_of(name: str) -> str:
    """What the job's ranks do, from its name: ``-fail-`` fails, ``-hang-`` never steps, else run."""
    return "fail" if "-fail-" in f"-{name}-" else "hang" if "-hang-" in f"-{name}-" else "run"


@dataclass
class SimCluster:
    bootstrap: str
    redis_url: str
    shape: ClusterShape
    first: int = 0
    count: int | None = None
    namespace: str = ""
    heartbeat_s: float = 2.0
    step_hz: float = 1.0
    fail_after_s: float = 5.0
    artifacts: str | None = None  # the artifact root: ranks write shards there (None: no checkpoints)
    checkpoint_every: int = 100
    counters: Counters = field(default_factory=Counters)
    ranks: dict[str, list[SimRank]] = field(default_factory=dict)  # allocation id -> our ranks of it

    def __post_init__(self) -> None:
        views = self.shape.views()
        last = len(views) if self.count is None else min(len(views), self.first + self.count)
        self.nodes = views[self.first:last]
        self.ours = {v.node_id for v in self.nodes}
        self.boot_id = uuid.uuid4().hex
        self._beats = {v.node_id: NodeHeartbeat(
            node_id=v.node_id, host=v.host, rack=v.rack, nvlink_domain=v.nvlink_domain,
            network_tier=v.network_tier, boot_id=self.boot_id, sandbox="enforce", warm_interpreters=0,
            devices=[DeviceInfo(index=d.index, type=d.type, memory_bytes=d.memory_bytes) for d in v.devices],
        ).model_dump(mode="json", by_alias=True) for v in self.nodes}
        self._step = StepMetrics(job_id="j", attempt=1, rank=0, step=1, loss=2.0, consumed_tokens=0,
                                 step_seconds=1.0, compute_seconds=0.8, collective_seconds=0.15,
                                 data_wait_seconds=0.05, tokens_per_second=8192.0).model_dump(mode="json",
                                                                                            by_alias=True)
        self._seq = 0
        self._running: dict[str, set[str]] = {}  # node id -> allocations with a rank there

    def topic(self, logical: str) -> str:
        return f"{self.namespace}{logical}"

    # ------------------------------------------------------------------ the loops
    async def run(self, ready: asyncio.Event | None = None) -> None:
        self.redis = Redis.from_url(self.redis_url)
        self.doorbell = Doorbell(self.redis)
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks=1, linger_ms=2,
                                         max_batch_size=1 << 20, enable_idempotence=False)
        consumer = AIOKafkaConsumer(
            self.topic(ALLOCATIONS), bootstrap_servers=self.bootstrap, auto_offset_reset="latest",
            group_id=f"sim-nodes-{self.first}-{uuid.uuid4().hex[:6]}", enable_auto_commit=True,
            fetch_max_wait_ms=FETCH_MAX_WAIT_MS, max_partition_fetch_bytes=16 << 20)
        await self.producer.start()
        await consumer.start()
        try:
            while not consumer.assignment():
                await asyncio.sleep(0.05)
            for tp in consumer.assignment():
                await consumer.position(tp)
            tasks = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._allocations(consumer)),
                     asyncio.create_task(self._steps()), asyncio.create_task(self._failures())]
            await self._beat_all()  # every node once before "ready"
            if ready is not None:
                ready.set()
            await asyncio.gather(*tasks)
        finally:
            await consumer.stop()
            await self.producer.stop()
            await self.redis.aclose()

    async def _send(self, logical: str, key: str, body: dict[str, Any]) -> None:
        await self.producer.send(self.topic(logical), json.dumps(body).encode(), key=key.encode(), headers=HEADERS)

    def _beat(self, node_id: str) -> dict[str, Any]:
        self._seq += 1
        return {**self._beats[node_id], "eventId": str(uuid.uuid4()), "occurredAt": now_iso(), "seq": self._seq,
                "runningAllocations": sorted(self._running.get(node_id, ()))}

    async def _beat_all(self) -> None:
        for v in self.nodes:
            await self._send(NODES, v.node_id, self._beat(v.node_id))
        await self.producer.flush()

    async def _heartbeats(self) -> None:
        """Every node once per interval, in slices of 50 ms (a real cluster's heartbeats are not in phase)."""
        slices = max(1, int(self.heartbeat_s / 0.05))
        per = -(-len(self.nodes) // slices)
        loop = asyncio.get_running_loop()
        start = loop.time()
        k = 0
        while True:
            worst = 0.0
            for s in range(slices):
                due = start + k * self.heartbeat_s + s * self.heartbeat_s / slices
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                worst = max(worst, -delay)
                for v in self.nodes[s * per:(s + 1) * per]:
                    await self._send(NODES, v.node_id, self._beat(v.node_id))
                    self.counters.heartbeats += 1
            self.counters.lag_s = worst
            k += 1

    async def _allocations(self, consumer: AIOKafkaConsumer) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=1000, max_records=500)
            for records in batches.values():
                for record in records:
                    try:
                        event = json.loads(record.value or b"")
                    except ValueError:
                        continue
                    kind = event.get("eventType")
                    if kind == "GangAllocated":
                        await self._allocated(event)
                    elif kind == "AllocationRevoked":
                        await self._revoked(event)
                    elif kind == "CheckpointRequested":
                        await self._checkpoint_requested(event)
            await self.doorbell.ring(self.topic(WORKERS))

    async def _allocated(self, event: dict[str, Any]) -> None:
        mine = [n for n in event["nodes"] if n["nodeId"] in self.ours]
        if not mine or event["allocationId"] in self.ranks:
            return
        self.counters.allocations += 1
        behaviour = behaviour_of(event["spec"].get("name", ""))
        now = time.monotonic()
        world = sum(len(share["ranks"]) for share in event["nodes"])
        ranks = []
        for share in mine:
            self._running.setdefault(share["nodeId"], set()).add(event["allocationId"])
            for slot in share["ranks"]:
                r = SimRank(event["jobId"], event["tenant"], event["attempt"], event["allocationId"],
                            event["epoch"], share["nodeId"], slot["rank"], behaviour, now, world)
                ranks.append(r)
                started = WorkerStarted(job_id=r.job_id, attempt=r.attempt, allocation_id=r.allocation_id,
                                        epoch=r.epoch, node_id=r.node_id, rank=r.rank, pid=100000 + r.rank,
                                        log_uri=f"sim://{r.node_id}/{r.job_id}/{r.rank}", start="warm",
                                        start_detail="simulated")
                await self._send(WORKERS, r.job_id, started.model_dump(mode="json", by_alias=True))
                self.counters.started += 1
        self.ranks[event["allocationId"]] = ranks

    async def _revoked(self, event: dict[str, Any]) -> None:
        await self._exit(event["allocationId"], 143, "revoked", "the allocation was revoked")

    async def _checkpoint_requested(self, event: dict[str, Any]) -> None:
        """As a rank does: save the next step (all our ranks of the allocation agree on it), report the
        shard, exit 7 ``preempted`` with it; without ``--artifacts`` stop without saving."""
        ranks = self.ranks.get(event["allocationId"])
        if not ranks or event["epoch"] < ranks[0].epoch or ranks[0].behaviour == "hang":
            return
        step = max(r.step for r in ranks) + 1
        for r in ranks:
            r.step = step
            if self.artifacts is not None:
                await self._shard(r)
        await self._exit(event["allocationId"], 7, "preempted", "checkpointed on request and stopped")

    async def _shard(self, r: SimRank) -> None:
        """A 64-byte shard of ``r.step`` in the job's checkpoint directory (rank 0 adds the ``.metadata``),
        reported as the SDK reports it."""
        assert self.artifacts is not None
        directory = ArtifactLayout(self.artifacts).checkpoint_dir(r.tenant, r.job_id, r.attempt, r.step)
        directory.mkdir(parents=True, exist_ok=True)
        shard = directory / f"__{r.rank}_0.distcp"
        data = f"{r.job_id} {r.attempt} {r.step} {r.rank}".encode().ljust(64, b".")
        extra = []
        if r.rank == 0:
            meta = directory / ".metadata"
            body = f"simulated world of {r.world_size}".encode()
            meta.write_bytes(body)
            extra = [FileDigest(uri=location_uri(meta), size_bytes=len(body), sha256=hashlib.sha256(body).hexdigest())]
        tmp = directory / f".{shard.name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, shard)
        out = ShardWritten(job_id=r.job_id, tenant=r.tenant, attempt=r.attempt, epoch=r.epoch, global_step=r.step,
                           rank=r.rank, world_size=r.world_size, uri=location_uri(shard), size_bytes=len(data),
                           sha256=hashlib.sha256(data).hexdigest(), extra_files=extra,
                           consumed_tokens=r.step * 8192 * r.world_size, write_seconds=0.0, stall_seconds=0.0)
        await self._send(CHECKPOINTS, r.job_id, out.model_dump(mode="json", by_alias=True))
        r.saved_step = r.step
        self.counters.shards += 1

    async def _exit(self, allocation_id: str, code: int, reason: str, detail: str, *,
                    only_rank0: bool = False) -> None:
        ranks = self.ranks.get(allocation_id)
        if not ranks:
            return
        leaving = [r for r in ranks if r.rank == 0] if only_rank0 else ranks
        for r in leaving:
            out = WorkerExited(job_id=r.job_id, attempt=r.attempt, allocation_id=r.allocation_id, epoch=r.epoch,
                               node_id=r.node_id, rank=r.rank, exit_code=code, reason=reason, detail=detail,
                               global_step=r.step)
            await self._send(WORKERS, r.job_id, out.model_dump(mode="json", by_alias=True))
            self.counters.exited += 1
        rest = [r for r in ranks if r not in leaving]
        if rest:
            self.ranks[allocation_id] = rest
        else:
            self.ranks.pop(allocation_id, None)
        for node in {r.node_id for r in leaving} - {r.node_id for r in rest}:
            self._running.get(node, set()).discard(allocation_id)

    async def _steps(self) -> None:
        """Every running rank reports a step every 1/step_hz s (spread over the period in 20 slices)."""
        if self.step_hz <= 0:
            return
        period = 1.0 / self.step_hz
        slices = 20
        while True:
            t0 = time.monotonic()
            ranks = [r for rs in list(self.ranks.values()) for r in rs if r.behaviour != "hang"]
            per = -(-len(ranks) // slices) if ranks else 0
            for s in range(slices):
                for r in ranks[s * per:(s + 1) * per]:
                    r.step += 1
                    body = {**self._step, "eventId": str(uuid.uuid4()), "occurredAt": now_iso(),
                            "jobId": r.job_id, "tenant": r.tenant, "attempt": r.attempt, "rank": r.rank,
                            "step": r.step, "loss": 2.0 + random.random() * 0.01,
                            "consumedTokens": r.step * 8192}
                    await self._send(METRICS, r.job_id, body)
                    self.counters.steps += 1
                    if self.artifacts is not None and r.step % self.checkpoint_every == 0:
                        await self._shard(r)
                await asyncio.sleep(max(0.0, t0 + (s + 1) * period / slices - time.monotonic()))

    async def _failures(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for allocation_id, ranks in list(self.ranks.items()):
                if ranks and ranks[0].behaviour == "fail" and now - ranks[0].started >= self.fail_after_s \
                        and any(r.rank == 0 for r in ranks):
                    await self._exit(allocation_id, 1, "error", "simulated failure", only_rank0=True)
                    await self.doorbell.ring(self.topic(WORKERS))


async def report(cluster: SimCluster, ready: asyncio.Event) -> None:
    await ready.wait()
    print(f"ready {len(cluster.nodes)}", flush=True)
    while True:
        await asyncio.sleep(1.0)
        print(cluster.counters.line(), flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", required=True, help="the broker (host:port)")
    p.add_argument("--redis-url", required=True, help="Redis (the doorbell the platform's consumers listen to)")
    p.add_argument("--namespace", default="", help="the stack's topic namespace")
    p.add_argument("--nodes", type=int, default=4096, help="nodes of the cluster (8 devices each)")
    p.add_argument("--first", type=int, default=0, help="the first node this process stands in for")
    p.add_argument("--count", type=int, help="how many nodes this process stands in for (default: the rest)")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="seconds between a node's heartbeats")
    p.add_argument("--step-hz", type=float, default=1.0, help="steps a second each running rank reports (0: none)")
    p.add_argument("--fail-after-s", type=float, default=5.0, help="when a -fail- job's rank 0 fails")
    p.add_argument("--artifacts", help="the stack's artifact root: ranks write tiny shards there (default: none)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between a rank's checkpoints")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> None:
    cluster = SimCluster(args.bootstrap, args.redis_url, ClusterShape(nodes=args.nodes), first=args.first,
                         count=args.count, namespace=args.namespace, heartbeat_s=args.heartbeat_s,
                         step_hz=args.step_hz, fail_after_s=args.fail_after_s, artifacts=args.artifacts,
                         checkpoint_every=args.checkpoint_every)
    ready = asyncio.Event()
    loop = asyncio.get_running_loop()
    main = asyncio.ensure_future(asyncio.gather(cluster.run(ready), report(cluster, ready)))
    loop.add_signal_handler(signal.SIGTERM, main.cancel)
    try:
        await main
    except asyncio.CancelledError:
        pass


if __name__ == "__main__":
    asyncio.run(amain(parse()))
