"""The outbox: state and event commit together; the relay publishes, with the trace context."""

from __future__ import annotations

import asyncio


from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_runtime.outbox import Outbox
from trainyard_contract.tracing import setup_tracing
from tests.integration.test_bus import wait_until

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_staged_events_are_published_with_their_trace_and_removed(env: dict, redis) -> None:
    setup_tracing("test")
    await ensure_topics(env["kafka_bootstrap"], partitions=2, namespace=env["topic_namespace"])
    outbox = Outbox(redis, "svc")
    event = ev.JobStateChanged(job_id="job-1", tenant="t", state="running")
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set("ty:test:state", "running")
        outbox.stage(pipe, event, traceparent=TRACEPARENT)
        await pipe.execute()
    assert await outbox.pending() == 1

    received: list[tuple[ev.JobStateChanged, str]] = []
    bus = Bus(env["kafka_bootstrap"], service_name="outbox-test", group_prefix=env["group_prefix"],
              topic_namespace=env["topic_namespace"])

    async def on_changed(e: ev.JobStateChanged) -> None:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        received.append((e, format(ctx.trace_id, "032x")))

    bus.subscribe(ev.JOBS, {ev.JobStateChanged: on_changed})
    async with bus:
        relay = asyncio.create_task(outbox.relay_forever(bus, idle_poll_s=0.2))
        await wait_until(lambda: received)
        relay.cancel()
    got, trace_id = received[0]
    assert got.event_id == event.event_id
    assert trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert await outbox.pending() == 0


async def test_the_relay_is_woken_when_the_transaction_has_executed_not_before(env: dict, redis) -> None:
    """A relay woken while the staging MULTI is still pending must not miss it: it idles for an hour here,
    so only the wake-up after EXEC can deliver the event."""
    await ensure_topics(env["kafka_bootstrap"], partitions=2, namespace=env["topic_namespace"])
    outbox = Outbox(redis, "svc-wake")
    received: list[ev.JobStateChanged] = []
    bus = Bus(env["kafka_bootstrap"], service_name="outbox-wake", group_prefix=env["group_prefix"],
              topic_namespace=env["topic_namespace"])

    async def on_changed(e: ev.JobStateChanged) -> None:
        received.append(e)

    bus.subscribe(ev.JOBS, {ev.JobStateChanged: on_changed})
    async with bus:
        relay = asyncio.create_task(outbox.relay_forever(bus, idle_poll_s=3600))
        try:
            await asyncio.sleep(0)  # the relay looks once (nothing staged) and idles
            for n in range(3):
                event = ev.JobStateChanged(job_id=f"job-{n}", tenant="t", state="running")
                async with redis.pipeline(transaction=True) as pipe:
                    pipe.set("ty:test:state", n)
                    outbox.stage(pipe, event)
                    outbox.stage(pipe, event)  # staged twice in one pipeline: still one wrapped execute
                    await asyncio.sleep(0.2)  # the relay runs while the MULTI is not yet sent
                    await pipe.execute()
                await wait_until(lambda n=n: len(received) >= 2 * (n + 1))
        finally:
            relay.cancel()
    assert [e.job_id for e in received] == ["job-0", "job-0", "job-1", "job-1", "job-2", "job-2"]
    assert await outbox.pending() == 0
