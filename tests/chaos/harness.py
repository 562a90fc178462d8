"""The chaos rig: the local stack (LocalStack on free ports in a temporary directory), jobs submitted
through the API, faults injected by signal, and the history the invariants are checked on.

Faults: ``kill -9`` of a rank, of a node agent, of each service, of the broker and of Redis, and
SIGSTOP of a rank past the hang timeout. A killed component is started again by ``LocalStack.up()``
(which restarts whatever is not running and waits until the stack is healthy); a killed rank is the
platform's to recover. Observation never depends on the broker: progress is read from the ranks'
spool files, state from Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from tests.chaos.invariants import AttemptSteps, LeaseOp
from trainyard_cli import infra
from trainyard_cli.stack import LocalStack, StackSettings
from trainyard_contract.events import TERMINAL_STATES, DatasetVersionPublished
from trainyard_contract.records import CheckpointRecord, JobRecord, checkpoint_id
from trainyard_contract.storage import ArtifactLayout, path_to_uri, uri_to_path
from trainyard_runtime.store import Keys, StateStore, connect_redis

TENANT = "dev"
SERVICES = ("api", "telemetry", "scheduler", "checkpoint-coordinator", "registry")

#: Settings of every component of the chaos stack (TRAINYARD_* for all of them; each takes its own).
CHAOS_ENV = {
    "TRAINYARD_TICK_S": "0.5",  # scheduler
    "TRAINYARD_RETRY_BACKOFF_S": "0.5",
    "TRAINYARD_RETRY_BACKOFF_MAX_S": "2",
    "TRAINYARD_RECONCILE_INTERVAL_S": "2",
    "TRAINYARD_NODE_TIMEOUT_S": "20",
    "TRAINYARD_START_TIMEOUT_S": "120",
    "TRAINYARD_API_MAX_ATTEMPTS": "12",  # api: the attempt budget of each job
    "TRAINYARD_HEARTBEAT_S": "1",  # node agents
    "TRAINYARD_KILL_GRACE_S": "2",
    "TRAINYARD_HANG_TIMEOUT_S": "6",
    "TRAINYARD_FIRST_STEP_TIMEOUT_S": "180",
    "TRAINYARD_LEASE_CHECK_S": "2",
    "TRAINYARD_SHARD_TIMEOUT_S": "60",  # checkpoint coordinator
    "TRAINYARD_SHARD_REPORT_RETRY_MAX_S": "2",
    "TRAINYARD_SWEEP_INTERVAL_S": "2",
    "TRAINYARD_GC_INTERVAL_S": "5",
    "TRAINYARD_ADVICE_INTERVAL_S": "5",
    "TRAINYARD_LOG_LEVEL": "INFO",
}


def chaos_spec(*, max_steps: int, every: int = 10, seed: int = 11, name: str = "chaos") -> dict[str, Any]:
    """A small GPT (with dropout, so a resume that lost RNG state could not end bitwise equal) on 2 ranks."""
    return {
        "specVersion": "v1", "name": name,
        "modelConfig": {"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 64, "maxSeqLen": 64, "dropout": 0.1},
        "dataset": "tinycorpus@v1", "codeRevision": "chaos",
        "resources": {"gpuType": "cpu", "gpuCount": 2}, "parallelism": {"data": 2},
        "checkpointPolicy": {"everySteps": every, "keepLast": 3},
        "training": {"seed": seed, "sequenceLength": 32, "microBatchSize": 4, "globalBatchSize": 16,
                     "learningRate": 3e-3, "lrSchedule": {"name": "cosine", "warmupSteps": 5}, "maxSteps": max_steps},
    }


@dataclass
class Fault:
    kind: str  # rank | hang | agent | service | broker | redis
    target: str
    at: float  # time.time()
    job_id: str | None = None
    step: int | None = None  # the job's progress when it was injected
    #: every unfinished job's (attempt, highest step) when it was injected: which fault hit which job where
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: checkpoints whose shards were spooled but that were not READY yet when it was injected
    #: (``<job>/step-…-a<n>``): the fault hit them while they were being assembled
    assembling: list[str] = field(default_factory=list)
    healed_at: float | None = None  # every killed component was running again (its own health beacon)
    settled_s: float | None = None  # heal → every checkpoint written meanwhile READY or FAILED


@dataclass
class ChaosRig:
    stack: LocalStack
    rng: random.Random
    faults: list[Fault] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    say: Callable[[str], None] = print

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    @contextlib.contextmanager
    def running(cls, state_dir: Path, *, seed: int, nodes: int = 2, devices: int = 4,
                extra_env: dict[str, str] | None = None, say: Callable[[str], None] = print,
                base_env: dict[str, str] | None = None) -> Iterator[ChaosRig]:
        """``base_env``: the stack's settings under ``extra_env`` (default CHAOS_ENV; ``{}``: the defaults)."""
        settings = StackSettings(
            state_dir=state_dir, kafka_port=infra.free_port(), redis_port=infra.free_port(),
            api_port=infra.free_port(), nodes=nodes, devices_per_node=devices, ready_timeout_s=180,
        )
        stack = LocalStack(settings, extra_env={**(CHAOS_ENV if base_env is None else base_env), **(extra_env or {})})
        rig = cls(stack, random.Random(seed), say=say)
        try:
            stack.up()
            rig.publish_dataset()
            yield rig
        finally:
            stack.down(timeout_s=10)

    @property
    def layout(self) -> ArtifactLayout:
        return ArtifactLayout(self.stack.s.artifact_root)

    def client(self) -> httpx.Client:
        token = self.stack.token_file.read_text().strip()
        return httpx.Client(base_url=self.stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10)

    def restart_dead(self, *, timeout_s: float = 120.0) -> float:
        """Start whatever was killed again and wait until each restarted service beacons its health
        itself; returns the seconds it took.

        ``LocalStack.up()`` alone is not enough: it counts health keys, and a service killed with -9
        leaves its key behind for the beacon's TTL, so up() would return while the new process is
        still importing, and the next fault would land in the middle of this outage.
        """
        started = time.monotonic()
        before = {c.name: c.pid for c in self.stack.components()}
        for attempt in range(5):
            try:
                self.stack.up()
                break
            except Exception as exc:  # noqa: BLE001 - died during start-up, Redis still loading its AOF: again
                self.say(f"restart attempt {attempt + 1} failed: {exc!r}"[:500])
                if attempt == 4:
                    raise
                time.sleep(1.0 + attempt)
        fresh = {c.name: c.pid for c in self.stack.components()
                 if c.name not in ("broker", "redis") and before.get(c.name) != c.pid}
        asyncio.run(self._until(lambda store: _beaconing(store, fresh), timeout_s,
                                f"fresh health beacons of {sorted(fresh)}"))
        healed = time.time()
        for fault in self.faults:
            if fault.healed_at is None and fault.kind not in ("rank", "hang"):
                fault.healed_at = healed
        return time.monotonic() - started

    # ------------------------------------------------------------------ dataset and jobs
    def publish_dataset(self) -> None:
        from trainyard.data import STDLIB_SOURCES, prepare_dataset

        path, sha, manifest = prepare_dataset(self.stack.s.artifact_root, "tinycorpus", "v1",
                                              sources=STDLIB_SOURCES[:6])
        tokenizer = getattr(getattr(manifest, "tokenizer", None), "version", None)
        event = DatasetVersionPublished(name="tinycorpus", version="v1", manifest_uri=path_to_uri(path), sha256=sha,
                                        tokenizer=tokenizer, num_tokens=getattr(manifest, "num_tokens", None))

        async def go() -> None:
            from trainyard_runtime.bus import Bus

            async with Bus(self.stack.kafka_bootstrap, service_name="chaos",
                           topic_namespace=self.stack.s.topic_namespace) as bus:
                await bus.publish(event)
            await self._until(lambda store: store.get_dataset("tinycorpus@v1"), 60, "the dataset registered")

        asyncio.run(go())

    def submit(self, spec: dict[str, Any]) -> str:
        with self.client() as client:
            resp = client.post("/v1/training-jobs", json=spec)
            assert resp.status_code == 202, resp.text
            job_id = resp.json()["jobId"]
        self.jobs.append(job_id)
        return job_id

    # ------------------------------------------------------------------ reading state (Redis, spools)
    def _redis_call(self, fn: Callable[[StateStore], Any]) -> Any:
        async def go() -> Any:
            redis = connect_redis(self.stack.redis_url)
            try:
                return await fn(StateStore(redis))
            finally:
                await redis.aclose()

        return asyncio.run(go())

    async def _until(self, probe: Callable[[StateStore], Any], timeout_s: float, what: str) -> Any:
        redis = connect_redis(self.stack.redis_url)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if value := await probe(StateStore(redis)):
                    return value
                await asyncio.sleep(0.3)
        finally:
            await redis.aclose()
        raise AssertionError(f"timed out waiting for {what}")

    def job(self, job_id: str) -> JobRecord | None:
        """The job's record, or None while Redis cannot be read."""
        try:
            return self._redis_call(lambda store: store.get_job(job_id))
        except Exception:  # noqa: BLE001 - Redis may be the thing that is down
            return None

    def spool_events(self, job_id: str, attempt: int) -> dict[int, list[dict[str, Any]]]:
        """Rank → the payloads its spool holds (the rank's own durable record of what it did)."""
        events_dir = self.layout.attempt_dir(TENANT, job_id, attempt) / "events"
        out: dict[int, list[dict[str, Any]]] = {}
        for path in sorted(events_dir.glob("rank-*.jsonl")):  # rank-<r>.jsonl, rank-<r>.g<n>.jsonl (faultTolerance)
            rank = int(path.stem.split("-")[1].split(".")[0])
            lines = out.setdefault(rank, [])
            for raw in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    lines.append(json.loads(raw)["payload"])
        return out

    def attempt_steps(self, job_id: str, attempt: int) -> list[int]:
        return [p["step"] for lines in self.spool_events(job_id, attempt).values() for p in lines
                if p.get("eventType") == "StepMetrics"]

    def progress(self, job_id: str) -> tuple[int, int]:
        """(current attempt number, highest step it completed; 0 before its first step), from the spools."""
        attempts_dir = self.layout.job_dir(TENANT, job_id) / "attempts"
        numbers = sorted(int(p.name) for p in attempts_dir.iterdir()) if attempts_dir.exists() else []
        if not numbers:
            return 0, 0
        steps = self.attempt_steps(job_id, numbers[-1])
        return numbers[-1], max(steps, default=0)

    def wait_running(self, job_id: str, *, steps_past_start: int = 2, timeout_s: float = 180,
                     after_attempt: int = 0) -> tuple[int, int]:
        """Wait until an attempt newer than ``after_attempt`` has completed a few steps; (attempt, step)."""
        deadline = time.monotonic() + timeout_s
        start: dict[int, int] = {}
        while time.monotonic() < deadline:
            attempt, step = self.progress(job_id)
            if attempt > after_attempt and step:
                first = start.setdefault(attempt, min(self.attempt_steps(job_id, attempt)))
                if step >= first + steps_past_start - 1:
                    return attempt, step
            record = self.job(job_id)
            if record is not None and record.state in TERMINAL_STATES:
                return attempt, step
            time.sleep(0.3)
        raise AssertionError(f"job {job_id}: no running attempt after {after_attempt} within {timeout_s:.0f}s; "
                             f"progress {self.progress(job_id)}")

    def wait_advance(self, job_id: str, steps: int, *, timeout_s: float = 180) -> tuple[int, int]:
        """Wait until the job has completed ``steps`` more steps (or a newer attempt its first), or ended."""
        attempt0, step0 = self.progress(job_id)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            attempt, step = self.progress(job_id)
            if (attempt > attempt0 and step) or (attempt == attempt0 and step >= step0 + steps):
                return attempt, step
            record = self.job(job_id)
            if record is not None and record.state in TERMINAL_STATES:
                return attempt, step
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} made no progress from {(attempt0, step0)} within {timeout_s:.0f}s")

    def wait_terminal(self, job_ids: list[str], timeout_s: float) -> dict[str, JobRecord]:
        deadline = time.monotonic() + timeout_s
        records: dict[str, JobRecord] = {}
        while time.monotonic() < deadline:
            for job_id in job_ids:
                record = self.job(job_id)
                if record is not None:
                    records[job_id] = record
            if len(records) == len(job_ids) and all(r.state in TERMINAL_STATES for r in records.values()):
                return records
            time.sleep(1.0)
        return records

    def rank_pids(self, job_id: str, attempt: int) -> dict[int, int]:
        """Rank → pid of the attempt's running ranks (the node agents' tables in Redis)."""
        async def go(store: StateStore) -> dict[int, int]:
            found: dict[int, int] = {}
            for node in range(self.stack.s.nodes):
                for raw in (await store.redis.hgetall(f"ty:agent:node-{node}:ranks")).values():
                    entry = json.loads(raw)
                    if entry["jobId"] == job_id and int(entry["attempt"]) == attempt:
                        found[int(entry["rank"])] = int(entry["pid"])
            return found

        return self._redis_call(go)

    def node_of(self, job_id: str, attempt: int, rank: int) -> str | None:
        record = self.job(job_id)
        if record is None:
            return None
        for a in record.attempts:
            if a.attempt == attempt:
                allocation = Path(self.layout.attempt_dir(TENANT, job_id, attempt))
                for f in allocation.glob("allocation.*.json"):
                    data = json.loads(f.read_text())
                    for node in data["nodes"]:
                        if any(r["rank"] == rank for r in node["ranks"]):
                            return node["nodeId"]
        return None

    # ------------------------------------------------------------------ checkpoints being assembled, settling
    def shards_spooled(self, job_id: str, attempt: int) -> dict[int, set[int]]:
        """Global step → the ranks whose spool holds its ShardWritten (a rank spools it once durable)."""
        out: dict[int, set[int]] = {}
        for rank, lines in self.spool_events(job_id, attempt).items():
            for p in lines:
                if p.get("eventType") == "ShardWritten":
                    out.setdefault(int(p["globalStep"]), set()).add(rank)
        return out

    def unsettled(self) -> dict[str, list[str]]:
        """Checkpoints that every rank of a live attempt has written (ShardWritten in each rank's spool)
        whose record is not READY, FAILED or DELETED yet: ``<job>/<checkpoint id>`` → its state."""
        async def go(store: StateStore) -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            for job_id in self.jobs:
                job = await store.get_job(job_id)
                if job is None or job.state in TERMINAL_STATES:
                    continue
                records = {c.checkpoint_id: c.state for c in await store.list_checkpoints(job_id)}
                for a in job.attempts:
                    if a.state not in ("starting", "running"):
                        continue
                    for step, ranks in sorted(self.shards_spooled(job_id, a.attempt).items()):
                        cid = checkpoint_id(step, a.attempt)
                        if len(ranks) >= a.world_size and records.get(cid) not in ("READY", "FAILED", "DELETED"):
                            out.setdefault(job_id, []).append(f"{cid} ({records.get(cid) or 'no record'})")
            return out

        return self._redis_call(go)

    def wait_settled(self, timeout_s: float) -> tuple[float, dict[str, list[str]]]:
        """Wait until :meth:`unsettled` is empty; (seconds waited, what was still unsettled at the end)."""
        started = time.monotonic()
        left: dict[str, list[str]] = {}
        while time.monotonic() - started < timeout_s:
            try:
                left = self.unsettled()
            except Exception as exc:  # noqa: BLE001 - Redis answering slowly right after a restart
                left = {"?": [f"Redis not readable: {exc!r}"[:200]]}
            if not left:
                break
            time.sleep(0.2)
        return time.monotonic() - started, left

    def wait_assembling(self, job_id: str, *, timeout_s: float = 30.0) -> str | None:
        """Wait until a rank of the job's current attempt spools a ShardWritten whose checkpoint is not
        READY yet, then a random moment of the relay/assembly window; ``<job>/<checkpoint id>``."""
        attempt, _ = self.progress(job_id)
        events_dir = self.layout.attempt_dir(TENANT, job_id, attempt) / "events"
        offsets = {p: p.stat().st_size for p in events_dir.glob("rank-*.jsonl")}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for path in sorted(events_dir.glob("rank-*.jsonl")):
                with contextlib.suppress(OSError):
                    with path.open("rb") as f:
                        f.seek(offsets.get(path, 0))
                        chunk = f.read()
                    complete = chunk[:chunk.rfind(b"\n") + 1]
                    offsets[path] = offsets.get(path, 0) + len(complete)
                    for raw in complete.splitlines():
                        with contextlib.suppress(ValueError, KeyError):
                            payload = json.loads(raw)["payload"]
                            if payload.get("eventType") == "ShardWritten":
                                # a random moment inside the window, which is short on an idle host (ranks
                                # relay their shards within milliseconds; READY follows the last one)
                                time.sleep(self.rng.uniform(0.0, 0.05))
                                return f"{job_id}/{checkpoint_id(int(payload['globalStep']), attempt)}"
            time.sleep(0.02)
        return None

    def checkpoint_state(self, ref: str) -> str | None:
        """The state of ``<job>/<checkpoint id>`` in Redis (None: no record)."""
        job_id, cid = ref.split("/", 1)
        record = self._redis_call(lambda store: store.get_checkpoint(job_id, cid))
        return record.state if record else None

    # ------------------------------------------------------------------ faults
    def _note(self, fault: Fault) -> Fault:
        for job_id in self.jobs:
            with contextlib.suppress(OSError, ValueError):
                fault.progress[job_id] = self.progress(job_id)
        self.faults.append(fault)
        self.say(f"[chaos] {fault.kind} {fault.target}" + (f" (job {fault.job_id} at step {fault.step})"
                                                            if fault.job_id else ""))
        return fault

    def kill_rank(self, job_id: str, *, stop: bool = False) -> Fault | None:
        """kill -9 (or SIGSTOP) one random running rank of the job's current attempt."""
        attempt, step = self.progress(job_id)
        pids = self.rank_pids(job_id, attempt)
        if not pids:
            return None
        rank = self.rng.choice(sorted(pids))
        os.kill(pids[rank], signal.SIGSTOP if stop else signal.SIGKILL)
        return self._note(Fault("hang" if stop else "rank", f"attempt {attempt} rank {rank} pid {pids[rank]}",
                                time.time(), job_id, step))

    def kill_component(self, name: str, kind: str) -> Fault:
        """kill -9 of one stack component (its pid file names it); it stays dead until restart_dead()."""
        component = next(c for c in self.stack.components() if c.name == name)
        os.kill(component.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):  # our child (LocalStack started it): reap it
            os.waitpid(component.pid, 0)
        return self._note(Fault(kind, name, time.time()))

    def kill_agent_of(self, job_id: str) -> Fault | None:
        attempt, _ = self.progress(job_id)
        node = self.node_of(job_id, attempt, self.rng.choice([0, 1]))
        if node is None:
            return None
        fault = self.kill_component(f"node-agent-{node.split('-')[1]}", "agent")
        fault.job_id = job_id
        return fault

    # ------------------------------------------------------------------ history
    def history(self) -> tuple[dict[str, JobRecord], dict[str, list[CheckpointRecord]], list[LeaseOp]]:
        async def go(store: StateStore) -> tuple[Any, Any, Any]:
            jobs = {j: await store.get_job(j) for j in self.jobs}
            ckpts = {j: await store.list_checkpoints(j) for j in self.jobs}
            audit = [LeaseOp.from_stream(f) for _, f in await store.redis.xrange(Keys.lease_audit)]
            return {k: v for k, v in jobs.items() if v}, ckpts, audit

        return self._redis_call(go)

    def attempt_summaries(self, job: JobRecord) -> list[AttemptSteps]:
        """Per attempt: where it started, the furthest step it completed, and whether its last save
        was still in flight at the end (started, but not durable on every rank: no ShardWritten in
        each rank's spool) and for how many steps."""
        every = job.spec.checkpoint_policy.every_steps or 0
        out = []
        for a in job.attempts:
            per_rank = self.spool_events(job.job_id, a.attempt)
            steps = [p["step"] for lines in per_rank.values() for p in lines if p.get("eventType") == "StepMetrics"]
            start = a.start_checkpoint.global_step if a.start_checkpoint else 0
            last = max(steps) if steps else None
            spooled = self.shards_spooled(job.job_id, a.attempt)
            in_flight = 0
            if last is not None and every:
                save = last - last % every  # the last save this attempt started
                if save > start and len(spooled.get(save, ())) < a.world_size:
                    in_flight = last - save
            out.append(AttemptSteps(attempt=a.attempt, state=a.state, start_step=start, last_step=last,
                                    in_flight=in_flight))
        return out

    def keep_evidence(self, dest: Path, job_ids: list[str], report: dict[str, Any]) -> Path:
        """Copy what a failing run needs to be diagnosed to ``dest``: the stack's logs and Redis data
        directory, the Redis state of ``job_ids`` and their checkpoints, their attempts' rank logs,
        spools, exit files and run records, their checkpoint manifests and file listings, the fault
        timeline and the report. Call it while Redis still runs."""
        dest.mkdir(parents=True, exist_ok=True)
        root = self.stack.s.root
        for name in ("logs", "redis"):
            if (root / name).is_dir():
                shutil.copytree(root / name, dest / name, dirs_exist_ok=True)
        for job_id in job_ids:
            job_dir = self.layout.job_dir(TENANT, job_id)
            if (job_dir / "attempts").is_dir():
                shutil.copytree(job_dir / "attempts", dest / "jobs" / job_id / "attempts", dirs_exist_ok=True)
            listing: dict[str, dict[str, int]] = {}
            for ckpt in sorted((job_dir / "checkpoints").glob("*")) if (job_dir / "checkpoints").is_dir() else []:
                listing[ckpt.name] = {f.name: f.stat().st_size for f in sorted(ckpt.iterdir()) if f.is_file()}
                if (ckpt / "manifest.json").exists():
                    target = dest / "jobs" / job_id / "checkpoints" / ckpt.name
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(ckpt / "manifest.json", target / "manifest.json")
            (dest / "jobs" / job_id).mkdir(parents=True, exist_ok=True)
            (dest / "jobs" / job_id / "checkpoint-files.json").write_text(json.dumps(listing, indent=2))
        try:
            state = self._redis_call(lambda store: _redis_state(store, job_ids, self.stack.s.nodes))
        except Exception as exc:  # noqa: BLE001 - the evidence must not hide the failure
            state = {"error": repr(exc)}
        (dest / "redis-state.json").write_text(json.dumps(state, indent=2, default=str))
        (dest / "faults.json").write_text(json.dumps([asdict(f) | {"atIso": _iso(f.at)} for f in self.faults],
                                                     indent=2, default=str))
        (dest / "chaos-report.json").write_text(json.dumps(report, indent=2, default=str))
        return dest

    def final_state(self, job_id: str, checkpoints: list[CheckpointRecord], max_steps: int,
                    tmp: Path) -> dict[str, Any]:
        """Every value of the job's READY checkpoint at ``max_steps``, loaded in this process."""
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        final = next(c for c in checkpoints if c.state == "READY" and c.global_step == max_steps)
        directory = uri_to_path(final.manifest_uri or "").parent
        out = tmp / f"{job_id}.pt"
        dcp_to_torch_save(directory, out)
        return torch.load(out, weights_only=False)


async def _beaconing(store: StateStore, fresh: dict[str, int]) -> bool:
    """Whether every component in ``fresh`` (name → pid) has written its own health beacon."""
    for name, pid in fresh.items():
        service = "node-agent" if name.startswith("node-agent-") else name
        keys = [k async for k in store.redis.scan_iter(match=Keys.health(service, "*"), count=100)]
        values = await store.redis.mget(keys) if keys else []
        if str(pid) not in values:
            return False
    return True


async def _redis_state(store: StateStore, job_ids: list[str], nodes: int) -> dict[str, Any]:
    """The Redis records behind ``job_ids``: job, checkpoints, shard reports, agents' tables, outboxes."""
    redis = store.redis

    async def hash_of(key: str) -> dict[str, Any]:
        return {k: _maybe_json(v) for k, v in (await redis.hgetall(key)).items()}

    out: dict[str, Any] = {"jobs": {}, "agents": {}, "outboxes": {}}
    for job_id in job_ids:
        shards = {}
        async for key in redis.scan_iter(match=f"{Keys.checkpoints(job_id)}:shards:*", count=1000):
            shards[key] = await hash_of(key)
        out["jobs"][job_id] = {
            "job": _maybe_json(await redis.get(Keys.job(job_id))),
            "epoch": await redis.get(Keys.epoch(job_id)),
            "checkpoints": await hash_of(Keys.checkpoints(job_id)),
            "shards": dict(sorted(shards.items())),
            "progress": _maybe_json(await redis.get(Keys.progress(job_id))),
            "advice": _maybe_json(await redis.get(Keys.checkpoint_advice(job_id))),
        }
    out["pendingCheckpoints"] = await redis.zrange(Keys.pending_checkpoints, 0, -1, withscores=True)
    for node in range(nodes):
        base = f"ty:agent:node-{node}"
        out["agents"][f"node-{node}"] = {"ranks": await hash_of(f"{base}:ranks"),
                                         "unconfirmed": await hash_of(f"{base}:unconfirmed")}
    async for key in redis.scan_iter(match="ty:outbox:*", count=100):
        out["outboxes"][key] = await redis.xlen(key)
    async for key in redis.scan_iter(match="ty:health:*", count=100):
        out.setdefault("health", {})[key] = await redis.get(key)
    return out


def _maybe_json(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _iso(at: float | None) -> str | None:
    return datetime.fromtimestamp(at, tz=timezone.utc).isoformat() if at else None
