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
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.chaos.invariants import AttemptSteps, LeaseOp
from trainyard_cli import infra
from trainyard_cli.stack import LocalStack, StackSettings
from trainyard_common.events import TERMINAL_STATES, DatasetVersionPublished
from trainyard_common.records import CheckpointRecord, JobRecord
from trainyard_common.storage import ArtifactLayout, path_to_uri, uri_to_path
from trainyard_common.store import Keys, StateStore, connect_redis

TENANT = "dev"
SERVICES = ("api", "scheduler", "checkpoint-coordinator", "registry")

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
                extra_env: dict[str, str] | None = None, say: Callable[[str], None] = print) -> Iterator[ChaosRig]:
        settings = StackSettings(
            state_dir=state_dir, kafka_port=infra.free_port(), redis_port=infra.free_port(),
            api_port=infra.free_port(), nodes=nodes, devices_per_node=devices, ready_timeout_s=180,
        )
        stack = LocalStack(settings, extra_env={**CHAOS_ENV, **(extra_env or {})})
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

    def restart_dead(self) -> float:
        """Start whatever was killed again and wait until the stack is healthy; returns the seconds it took."""
        started = time.monotonic()
        for attempt in range(3):
            try:
                self.stack.up()
                break
            except Exception as exc:  # noqa: BLE001 - a component that died during start-up: once more
                self.say(f"restart attempt {attempt + 1} failed: {exc!r}"[:500])
                if attempt == 2:
                    raise
        return time.monotonic() - started

    # ------------------------------------------------------------------ dataset and jobs
    def publish_dataset(self) -> None:
        from trainyard_trainer.data import STDLIB_SOURCES, prepare_dataset

        path, sha, manifest = prepare_dataset(self.stack.s.artifact_root, "tinycorpus", "v1",
                                              sources=STDLIB_SOURCES[:6])
        tokenizer = getattr(getattr(manifest, "tokenizer", None), "version", None)
        event = DatasetVersionPublished(name="tinycorpus", version="v1", manifest_uri=path_to_uri(path), sha256=sha,
                                        tokenizer=tokenizer, num_tokens=getattr(manifest, "num_tokens", None))

        async def go() -> None:
            from trainyard_common.bus import Bus

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
        for path in sorted(events_dir.glob("rank-*.jsonl")):
            rank = int(path.stem.split("-")[1])
            lines = []
            for raw in path.read_text().splitlines():
                with contextlib.suppress(ValueError, KeyError):
                    lines.append(json.loads(raw)["payload"])
            out[rank] = lines
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

    # ------------------------------------------------------------------ faults
    def _note(self, fault: Fault) -> Fault:
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
        """Per attempt: where it started, the furthest step it completed, and how far an asynchronous
        save lagged behind training (a finished save's lag, or the save still in flight at the end)."""
        every = job.spec.checkpoint_policy.every_steps or 0
        out = []
        for a in job.attempts:
            per_rank = self.spool_events(job.job_id, a.attempt)
            steps = [p["step"] for lines in per_rank.values() for p in lines if p.get("eventType") == "StepMetrics"]
            start = a.start_checkpoint.global_step if a.start_checkpoint else 0
            last = max(steps) if steps else None
            durable = {p["globalStep"] for lines in per_rank.values() for p in lines
                       if p.get("eventType") == "ShardWritten"}
            lag = max(map(async_lag, per_rank.values()), default=0)
            if last is not None and every:
                save = last - last % every  # the last save this attempt started
                if save > start and save not in durable:
                    lag = max(lag, last - save)
            out.append(AttemptSteps(attempt=a.attempt, state=a.state, start_step=start, last_step=last,
                                    async_lag=lag))
        return out

    def final_state(self, job_id: str, checkpoints: list[CheckpointRecord], max_steps: int, tmp: Path) -> dict[str, Any]:
        """Every value of the job's READY checkpoint at ``max_steps``, loaded in this process."""
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        final = next(c for c in checkpoints if c.state == "READY" and c.global_step == max_steps)
        directory = uri_to_path(final.manifest_uri or "").parent
        out = tmp / f"{job_id}.pt"
        dcp_to_torch_save(directory, out)
        return torch.load(out, weights_only=False)


def async_lag(payloads: list[dict[str, Any]]) -> int:
    """How many steps past a checkpoint's step the rank went before its shard was durable (max)."""
    last_step, lag = 0, 0
    for p in payloads:
        if p.get("eventType") == "StepMetrics":
            last_step = p["step"]
        elif p.get("eventType") == "ShardWritten":
            lag = max(lag, last_step - p["globalStep"])
    return lag
