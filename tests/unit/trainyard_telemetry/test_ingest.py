"""The ingest hands every StepMetrics to each read model's writer, in the order its docstring gives, and
StragglerDetected to the step timing; nothing else consumes (the API reads what they write)."""

from __future__ import annotations

from typing import Any

import pytest

from trainyard_contract import events as ev
from trainyard_telemetry.ingest import Ingest


class Recorder:
    def __init__(self, calls: list[tuple[str, Any]], name: str) -> None:
        self.calls, self.name = calls, name

    async def on_step_metrics(self, m: ev.StepMetrics) -> None:
        self.calls.append((self.name, m.step))

    async def on_straggler(self, e: ev.StragglerDetected) -> None:
        self.calls.append((f"{self.name}:straggler", e.rank))

    def on_step(self, m: ev.StepMetrics) -> None:
        self.calls.append((self.name, m.step))


class FakeBus:
    def __init__(self) -> None:
        self.subscribed: dict[str, dict[type, Any]] = {}

        self.batched: dict[str, tuple[type, Any, str]] = {}
        self.group_prefix = "trainyard"

    def subscribe(self, topic: str, handlers: dict[type, Any], **_: Any) -> str:
        self.subscribed[topic] = handlers
        return topic

    def subscribe_batch(self, topic: str, event_class: type, handler: Any, *, group: str, **_: Any) -> str:
        self.batched[topic] = (event_class, handler, group)
        return group


class FakeRuntime:
    def __init__(self) -> None:
        self.bus = FakeBus()


async def test_each_step_reaches_every_read_model_in_order_and_stragglers_the_step_timing() -> None:
    calls: list[tuple[str, Any]] = []
    ingest = Ingest(Recorder(calls, "timing"), Recorder(calls, "history"),  # type: ignore[arg-type]  # test doubles
                    Recorder(calls, "progress"), Recorder(calls, "series"))  # type: ignore[arg-type]  # as above
    runtime = FakeRuntime()
    ingest.install(runtime)  # type: ignore[arg-type]  # a stand-in runtime
    assert set(runtime.bus.subscribed) == {ev.WORKERS}
    assert list(runtime.bus.subscribed[ev.WORKERS]) == [ev.StragglerDetected]
    event_class, on_batch, group = runtime.bus.batched[ev.METRICS]  # the busiest stream: a batch at a time
    assert event_class is ev.StepMetrics and group == "trainyard.telemetry-metrics"

    await on_batch([ev.StepMetrics(job_id="job-1", attempt=1, rank=0, step=7, loss=1.0, consumed_tokens=0)])
    await runtime.bus.subscribed[ev.WORKERS][ev.StragglerDetected](ev.StragglerDetected(
        job_id="job-1", attempt=1, rank=3, node_id="n", slowdown=2.0, window_steps=5, from_step=1, to_step=5))
    assert calls == [("timing", 7), ("history", 7), ("progress", 7), ("series", 7), ("timing:straggler", 3)]


async def test_a_batch_keeps_each_ranks_steps_in_order_and_fails_whole_if_any_rank_fails() -> None:
    seen: dict[int, list[int]] = {}

    class ByRank(Recorder):
        async def on_step_metrics(self, m: ev.StepMetrics) -> None:
            seen.setdefault(m.rank, []).append(m.step)
            if m.rank == 1 and m.step == 2 and self.name == "failing":
                raise RuntimeError("redis blinked")

    batch = [ev.StepMetrics(job_id="job-1", attempt=1, rank=rank, step=step, loss=1.0, consumed_tokens=0)
             for step in (1, 2, 3) for rank in (0, 1)]
    calls: list[tuple[str, Any]] = []
    ingest = Ingest(ByRank(calls, "timing"), Recorder(calls, "history"),  # type: ignore[arg-type]  # test doubles
                    Recorder(calls, "progress"), Recorder(calls, "series"))  # type: ignore[arg-type]  # as above
    await ingest.on_step_metrics_batch(batch)
    assert seen == {0: [1, 2, 3], 1: [1, 2, 3]}  # each rank's steps in their order
    assert sorted(step for name, step in calls if name == "series") == [1, 1, 2, 2, 3, 3]  # every event, every model

    seen.clear()
    failing = Ingest(ByRank([], "failing"), Recorder([], "history"),  # type: ignore[arg-type]  # test doubles
                     Recorder([], "progress"), Recorder([], "series"))  # type: ignore[arg-type]  # as above
    with pytest.raises(RuntimeError):  # the batch fails: the bus hands it back (the models are idempotent)
        await failing.on_step_metrics_batch(batch)
    assert seen == {0: [1, 2, 3], 1: [1, 2]}  # rank 1 stopped at its failure, no later step of it first
