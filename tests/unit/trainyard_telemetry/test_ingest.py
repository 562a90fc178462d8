"""The ingest hands every StepMetrics to each read model's writer, in the order its docstring gives, and
StragglerDetected to the step timing; nothing else consumes (the API reads what they write)."""

from __future__ import annotations

from typing import Any

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

    def subscribe(self, topic: str, handlers: dict[type, Any], **_: Any) -> str:
        self.subscribed[topic] = handlers
        return topic


class FakeRuntime:
    def __init__(self) -> None:
        self.bus = FakeBus()


async def test_each_step_reaches_every_read_model_in_order_and_stragglers_the_step_timing() -> None:
    calls: list[tuple[str, Any]] = []
    ingest = Ingest(Recorder(calls, "timing"), Recorder(calls, "history"),  # type: ignore[arg-type]  # test doubles
                    Recorder(calls, "progress"), Recorder(calls, "series"))  # type: ignore[arg-type]  # as above
    runtime = FakeRuntime()
    ingest.install(runtime)  # type: ignore[arg-type]  # a stand-in runtime
    assert set(runtime.bus.subscribed) == {ev.METRICS, ev.WORKERS}
    assert list(runtime.bus.subscribed[ev.METRICS]) == [ev.StepMetrics]
    assert list(runtime.bus.subscribed[ev.WORKERS]) == [ev.StragglerDetected]

    await runtime.bus.subscribed[ev.METRICS][ev.StepMetrics](ev.StepMetrics(
        job_id="job-1", attempt=1, rank=0, step=7, loss=1.0, consumed_tokens=0))
    await runtime.bus.subscribed[ev.WORKERS][ev.StragglerDetected](ev.StragglerDetected(
        job_id="job-1", attempt=1, rank=3, node_id="n", slowdown=2.0, window_steps=5, from_step=1, to_step=5))
    assert calls == [("timing", 7), ("history", 7), ("progress", 7), ("series", 7), ("timing:straggler", 3)]
