"""The ingest hands every StepMetrics to each read model's writer, in the order its docstring gives, and
StragglerDetected to the step timing; nothing else consumes (the API reads what they write)."""

from __future__ import annotations

from typing import Any

import pytest

from trainyard_contract import events as ev
from trainyard_telemetry.ingest import Ingest


class FakePipe:
    def __init__(self, calls: list[tuple[str, Any]], fail: bool) -> None:
        self.calls, self.fail = calls, fail

    async def __aenter__(self) -> FakePipe:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    def zadd(self, key: str, mapping: dict[str, float]) -> None:
        self.calls.append(("marked", sorted(mapping)))  # the jobs the tracking exporter looks at

    async def execute(self) -> list[Any]:
        if self.fail:
            raise ConnectionError("redis blinked")
        self.calls.append(("execute", None))
        return []


class FakeRedis:
    def __init__(self, calls: list[tuple[str, Any]], fail: bool = False) -> None:
        self.calls, self.fail = calls, fail

    def pipeline(self, transaction: bool = True) -> FakePipe:
        assert transaction is False
        return FakePipe(self.calls, self.fail)


class Recorder:
    def __init__(self, calls: list[tuple[str, Any]], name: str, *, fail: bool = False) -> None:
        self.calls, self.name = calls, name
        self.redis = FakeRedis(calls, fail)

    async def on_step_metrics(self, m: ev.StepMetrics) -> None:
        self.calls.append((self.name, m.step))

    async def stage(self, pipe: FakePipe, m: ev.StepMetrics) -> None:
        self.calls.append((f"{self.name}:staged", (m.rank, m.step)))

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
    assert calls == [("timing:staged", (0, 7)), ("history:staged", (0, 7)), ("marked", ["job-1"]), ("execute", None),
                     ("progress", 7),
                     ("series", 7), ("timing:straggler", 3)]


async def test_a_batch_is_written_in_one_round_trip_in_order_and_fails_whole() -> None:
    batch = [ev.StepMetrics(job_id="job-1", attempt=1, rank=rank, step=step, loss=1.0, consumed_tokens=0)
             for step in (1, 2, 3) for rank in (0, 1)]
    calls: list[tuple[str, Any]] = []
    ingest = Ingest(Recorder(calls, "timing"), Recorder(calls, "history"),  # type: ignore[arg-type]  # test doubles
                    Recorder(calls, "progress"), Recorder(calls, "series"))  # type: ignore[arg-type]  # as above
    await ingest.on_step_metrics_batch(batch)
    staged = [v for name, v in calls if name == "timing:staged"]
    assert staged == [(m.rank, m.step) for m in batch]  # every event, in the batch's order
    assert [v for name, v in calls if name == "history:staged"] == staged
    assert calls.count(("execute", None)) == 1  # one round trip for the batch
    assert [v for name, v in calls if name == "marked"] == [["job-1"]]  # in that round trip, once per job
    executed = calls.index(("execute", None))
    assert [v for name, v in calls[executed:] if name == "progress"] == [1, 2, 3]  # rank 0's, after the writes
    assert sorted(v for name, v in calls if name == "series") == [1, 1, 2, 2, 3, 3]

    calls.clear()
    failing = Ingest(Recorder(calls, "timing", fail=True), Recorder(calls, "history"),  # type: ignore[arg-type]
                     Recorder(calls, "progress"), Recorder(calls, "series"))  # type: ignore[arg-type]  # doubles
    with pytest.raises(ConnectionError):  # the batch fails whole: the bus hands it back (the writes are idempotent)
        await failing.on_step_metrics_batch(batch)
    assert not [name for name, _ in calls if name in ("progress", "series")]
