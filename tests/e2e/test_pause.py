"""A pause takes the checkpoint the ranks agree on after it, never one already being assembled.

A real job (torch ranks, the whole local stack) is paused while its scheduled checkpoint is being assembled: the
checkpoint coordinator is frozen (SIGSTOP) while the ranks write that checkpoint's shards, then the node agents
are frozen too, so the pause request waits on the broker; the scheduler records the pause, the coordinator is
let go and makes the scheduled checkpoint READY, and the scheduler handles that READY before any rank could have
answered. Then the agents go on: the ranks save the step they agree on, exit 7 by themselves, and the job pauses
at that step — past the step the ranks had reached when the pause was asked — and resumes from it, to the end,
with no step trained twice or lost. (Before: the scheduler declared the pause at the in-flight checkpoint, the
ranks were SIGTERMed, and the steps after it were lost.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from aiokafka import AIOKafkaConsumer

from trainyard_cli.stack import LocalStack
from trainyard_contract import events as ev
from trainyard_runtime.bus import Deduper
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import StateStore, connect_redis
from tests.support.stack import running_stack
from tests.support.waiting import wait_for, wait_for_state

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
WORLD = 2
MAX_STEPS, EVERY = 200, 10
TOKENS_PER_STEP = 32 * 64  # globalBatchSize × sequenceLength of examples/tiny.yaml
AGENTS_FROZEN_AT_MOST_S = 8.0  # well inside the scheduler's node timeout (15 s): nothing is judged lost


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from running_stack(tmp_path_factory, "pause")


class CheckpointTap:
    """The CHECKPOINTS events of one job as they reach the broker (its own thread and event loop)."""

    def __init__(self, stack: LocalStack, job_id: str) -> None:
        self.bootstrap, self.job_id = stack.kafka_bootstrap, job_id
        self.topic = stack.s.topic_namespace + ev.CHECKPOINTS
        self.seen: list[ev.Event] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._consume()), daemon=True)

    def __enter__(self) -> CheckpointTap:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    async def _consume(self) -> None:
        consumer = AIOKafkaConsumer(self.topic, bootstrap_servers=self.bootstrap, group_id=None,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        await consumer.start()
        try:
            while not self._stop.is_set():
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    for record in records:
                        try:
                            event = ev.decode_event(ev.CHECKPOINTS, record.value or b"")
                        except ValueError:
                            continue
                        if getattr(event, "job_id", None) == self.job_id:
                            with self._lock:
                                self.seen.append(event)
        finally:
            await consumer.stop()

    def events(self, cls: type[ev.Event]) -> list[Any]:
        with self._lock:
            return [e for e in self.seen if isinstance(e, cls)]

    def assembled_steps(self, attempt: int) -> list[int]:
        """Steps every rank of ``attempt`` has reported its shard of, in order."""
        ranks: dict[int, set[int]] = {}
        for shard in self.events(ev.ShardWritten):
            if shard.attempt == attempt:
                ranks.setdefault(shard.global_step, set()).add(shard.rank)
        return sorted(step for step, got in ranks.items() if len(got) == WORLD)


def redis_read(stack: LocalStack, read: Callable[[StateStore], Any]) -> Any:
    async def go() -> Any:
        redis = connect_redis(stack.redis_url)
        try:
            return await read(StateStore(redis))
        finally:
            await redis.aclose()

    return asyncio.run(go())


def job_record(stack: LocalStack, job_id: str) -> JobRecord:
    job = redis_read(stack, lambda store: store.get_job(job_id))
    assert job is not None
    return job


def scheduler_handled(stack: LocalStack, event: ev.Event) -> bool:
    """Whether the scheduler has handled ``event`` (its consumer group's record of handled event ids)."""
    return redis_read(stack, lambda store: Deduper(store.redis, "scheduler",
                                                   "trainyard.scheduler").seen(str(event.event_id)))


def pids(stack: LocalStack, *names: str) -> list[int]:
    found = {c.name: c.pid for c in stack.components()}
    return [found[n] for n in names]


def last_step_trained(stack: LocalStack, job_id: str, attempt: int) -> int:
    """The highest step rank 0 has reported in its event spool (the ranks' own record, not the API's view)."""
    (spool,) = stack.s.artifact_root.glob(f"**/jobs/{job_id}/attempts/{attempt}/events/rank-0.jsonl")
    steps = [0]
    for line in spool.read_text().splitlines():
        try:
            payload = json.loads(line)["payload"]
        except (ValueError, KeyError):  # the line being written
            continue
        if payload.get("eventType") == "StepMetrics":
            steps.append(int(payload["step"]))
    return max(steps)


def client_for(stack: LocalStack) -> httpx.Client:
    token = stack.token_file.read_text().strip()
    return httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def test_a_pause_while_a_scheduled_checkpoint_is_assembled_stops_at_the_ranks_own_step(stack: LocalStack) -> None:
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["training"]["maxSteps"] = MAX_STEPS
    spec["checkpointPolicy"] = {"everySteps": EVERY, "keepLast": 5}
    coordinator, *agents = pids(stack, "checkpoint-coordinator", "node-agent-0", "node-agent-1")
    frozen: set[int] = set()

    def freeze(*which: int) -> None:
        for pid in which:
            os.kill(pid, signal.SIGSTOP)
            frozen.add(pid)

    def thaw(*which: int) -> None:
        for pid in which:
            if pid in frozen:
                os.kill(pid, signal.SIGCONT)
                frozen.discard(pid)

    with client_for(stack) as client:
        job_id = client.post("/v1/training-jobs", json=spec).raise_for_status().json()["jobId"]
        with CheckpointTap(stack, job_id) as tap:
            try:
                wait_for_state(client, job_id, {"running"}, timeout_s=180)
                # (on a shared host an attempt can fail to rendezvous and be retried: follow the one that runs)
                attempt = wait_for(lambda: (a := job_record(stack, job_id).current) is not None and a.state == "running"
                                   and len(a.started_ranks) == WORLD and a.attempt, "ranks running",
                                   timeout_s=180, every_s=0.05)
                # 1. the coordinator stops assembling: the next scheduled checkpoint's shards wait on the broker
                freeze(coordinator)
                ready_before = {e.global_step for e in tap.events(ev.CheckpointReady)}
                in_flight = wait_for(lambda: [s for s in tap.assembled_steps(attempt) if s not in ready_before],
                                     "every shard of a scheduled checkpoint on the broker",
                                     timeout_s=120, every_s=0.05)[0]
                assert in_flight % EVERY == 0 and in_flight < MAX_STEPS
                # 2. the agents stop relaying: the pause request reaches no rank until they go on
                freeze(*agents)
                frozen_at = time.monotonic()
                reached = last_step_trained(stack, job_id, attempt)
                assert client.post(f"/v1/training-jobs/{job_id}/pause").status_code == 202
                wait_for(lambda: job_record(stack, job_id).control == "pause", "the scheduler to record the pause",
                         timeout_s=AGENTS_FROZEN_AT_MOST_S, every_s=0.05)
                # 3. the in-flight checkpoint becomes READY and the scheduler handles it before any rank answered
                thaw(coordinator)
                left = max(0.5, AGENTS_FROZEN_AT_MOST_S - (time.monotonic() - frozen_at))
                with_ready = [e for e in tap.events(ev.CheckpointReady) if e.global_step == in_flight]
                deadline = time.monotonic() + left
                while time.monotonic() < deadline and not (with_ready and scheduler_handled(stack, with_ready[0])):
                    time.sleep(0.05)
                    with_ready = [e for e in tap.events(ev.CheckpointReady) if e.global_step == in_flight]
            finally:
                thaw(*agents, coordinator)

            paused = wait_for_state(client, job_id, {"paused", "failed", "succeeded", "cancelled"}, timeout_s=180)
        assert paused["state"] == "paused", json.dumps(paused)[:3000]
        record = job_record(stack, job_id)
        first = record.attempts[attempt - 1]
        # the ranks exited 7 by themselves, with their checkpoint; nobody SIGTERMed them
        assert first.state == "revoked" and first.exited_ranks == {str(r): 7 for r in range(WORLD)}, first
        pause_step = first.ready_step_at_end
        assert f"its ranks stopped and the checkpoint at step {pause_step} is READY" in (first.failure_reason or "")
        # not the checkpoint in flight at the request: one the ranks agreed on after it, past where they were
        assert pause_step > in_flight and pause_step >= reached, (pause_step, in_flight, reached)

        assert client.post(f"/v1/training-jobs/{job_id}/resume").status_code == 202
        done = wait_for_state(client, job_id, {"succeeded", "failed", "cancelled"}, timeout_s=600)
        assert done["state"] == "succeeded", json.dumps(done)[:3000]
        assert done["attempts"][attempt]["startCheckpoint"]["globalStep"] == pause_step
        assert done["progress"]["globalStep"] == MAX_STEPS
        assert done["progress"]["consumedTokens"] == MAX_STEPS * TOKENS_PER_STEP  # nothing trained twice or skipped
        assert done["goodput"]["wasted"]["lostWork"] == pytest.approx(0, abs=1e-6)  # the pause lost no step
