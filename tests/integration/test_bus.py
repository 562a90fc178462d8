"""The bus against a real Kafka-protocol broker: delivery, dead letters, retries, dedupe."""

from __future__ import annotations

import asyncio
import base64
from collections import Counter
from collections.abc import Callable


from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus, Deduper, ensure_topics
from trainyard_runtime.retry import RetryPolicy
from trainyard_contract.errors import StateStoreError, TrainyardError


async def wait_until(pred: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


def heartbeat(node: str = "n1", seq: int = 0) -> ev.NodeHeartbeat:
    return ev.NodeHeartbeat(node_id=node, host="h", seq=seq,
                            devices=[ev.DeviceInfo(index=0, type="cpu", memory_bytes=1)])


async def make_bus(env: dict, name: str = "test") -> Bus:
    await ensure_topics(env["kafka_bootstrap"], partitions=2, namespace=env["topic_namespace"])
    return Bus(env["kafka_bootstrap"], service_name=name, group_prefix=env["group_prefix"],
               topic_namespace=env["topic_namespace"])


async def test_topics_are_created_once(env: dict) -> None:
    first = await ensure_topics(env["kafka_bootstrap"], partitions=2, namespace=env["topic_namespace"])
    again = await ensure_topics(env["kafka_bootstrap"], partitions=2, namespace=env["topic_namespace"])
    assert sorted(first) == sorted(env["topic_namespace"] + t for t in ev.ALL_TOPICS)
    assert again == []


async def test_malformed_messages_go_to_dead_letter_and_consumer_carries_on(env: dict) -> None:
    bus = await make_bus(env)
    seen: list[ev.NodeHeartbeat] = []
    letters: list[ev.DeadLetter] = []

    async def on_heartbeat(e: ev.NodeHeartbeat) -> None:
        seen.append(e)

    async def on_letter(e: ev.DeadLetter) -> None:
        letters.append(e)

    bus.subscribe(ev.NODES, {ev.NodeHeartbeat: on_heartbeat})
    bus.subscribe(ev.DEADLETTER, {ev.DeadLetter: on_letter}, group=f"{env['group_prefix']}.dlq-reader")
    async with bus:
        await bus.publish(heartbeat(seq=1))
        await bus.publish_raw(ev.NODES, b"\x00garbage", key="n1")
        await bus.publish_raw(ev.NODES, b'{"eventType":"NodeHeartbeat","nodeId":"n1"}', key="n1")
        await bus.publish(heartbeat(seq=2))
        await wait_until(lambda: len(seen) == 2 and len(letters) == 2)
    assert [h.seq for h in seen] == [1, 2]
    raw = sorted(base64.b64decode(dl.raw_b64) for dl in letters)
    assert raw == sorted([b"\x00garbage", b'{"eventType":"NodeHeartbeat","nodeId":"n1"}'])
    for dl in letters:
        assert dl.source_topic == ev.NODES and dl.offset >= 0 and dl.partition >= 0
        assert "invalid event" in dl.error
        assert dl.consumer_group == f"{env['group_prefix']}.test"


async def test_failing_handler_is_dead_lettered_retryable_one_is_retried(env: dict, redis) -> None:
    bus = await make_bus(env)
    attempts: dict[int, int] = {}
    handled: list[int] = []
    letters: list[ev.DeadLetter] = []

    async def on_heartbeat(e: ev.NodeHeartbeat) -> None:
        attempts[e.seq] = attempts.get(e.seq, 0) + 1
        if e.seq == 1:
            raise TrainyardError("this event can never be applied")
        if e.seq == 2 and attempts[2] < 3:
            raise StateStoreError("redis blinked")  # retryable: must come back, not be skipped
        handled.append(e.seq)

    async def on_letter(e: ev.DeadLetter) -> None:
        letters.append(e)

    bus.subscribe(ev.NODES, {ev.NodeHeartbeat: on_heartbeat},
                  deduper_factory=lambda g: Deduper(redis, "test", g))
    bus.subscribe(ev.DEADLETTER, {ev.DeadLetter: on_letter}, group=f"{env['group_prefix']}.dlq-reader")
    async with bus:
        for seq in (1, 2, 3):
            await bus.publish(heartbeat(seq=seq))
        await wait_until(lambda: 3 in handled and 2 in handled and letters)
    assert attempts[1] == 1 and attempts[2] == 3
    assert "handler error: TrainyardError" in letters[0].error


async def test_a_message_backing_off_holds_up_only_its_partition_not_the_groups_other_topics(env: dict) -> None:
    """One group reads NODES and WORKERS. A heartbeat whose handler fails (retryable) waits a minute before
    its next try: meanwhile the group's other topic is handled (a back-off used to sleep the whole group),
    and the failing message is not tried again before its back-off (its partition is paused, not hot-looped)."""
    bus = await make_bus(env)
    tries: list[int] = []
    others: list[str] = []

    async def on_heartbeat(e: ev.NodeHeartbeat) -> None:
        tries.append(e.seq)
        raise StateStoreError("redis blinked")  # retryable, every time

    async def on_started(e: ev.WorkerStarted) -> None:
        others.append(e.job_id)

    bus.subscribe(ev.NODES, {ev.NodeHeartbeat: on_heartbeat},
                  retry=RetryPolicy(initial_interval_s=60.0, maximum_interval_s=60.0))
    bus.subscribe(ev.WORKERS, {ev.WorkerStarted: on_started})
    async with bus:
        await bus.publish(heartbeat(seq=1))
        await wait_until(lambda: tries == [1])
        for i in range(3):
            await bus.publish(ev.WorkerStarted(job_id=f"job-{i}", attempt=1, allocation_id="a", epoch=1,
                                               node_id="n1", rank=0, pid=1, log_uri="file:///logs/rank-0.log"))
        await wait_until(lambda: len(others) == 3)  # within the wait: well before the heartbeat's minute is up
        assert tries == [1]  # not tried again before its back-off
    assert sorted(others) == ["job-0", "job-1", "job-2"]


async def test_duplicate_event_ids_have_no_effect(env: dict, redis) -> None:
    bus = await make_bus(env)
    handled: list[str] = []

    async def on_heartbeat(e: ev.NodeHeartbeat) -> None:
        handled.append(str(e.event_id))

    bus.subscribe(ev.NODES, {ev.NodeHeartbeat: on_heartbeat}, deduper_factory=lambda g: Deduper(redis, "test", g))
    async with bus:
        once = heartbeat(seq=5)
        for _ in range(3):
            await bus.publish(once)
        marker = heartbeat(seq=6)
        await bus.publish(marker)
        await wait_until(lambda: str(marker.event_id) in handled)
    assert handled.count(str(once.event_id)) == 1


CRASHING_CONSUMER = """
import asyncio, sys, pathlib
from trainyard_contract import events as ev
from trainyard_runtime.bus import Bus
bootstrap, namespace, group, marker = sys.argv[1:5]
async def main():
    bus = Bus(bootstrap, service_name="crasher", topic_namespace=namespace)
    async def hang(e):
        pathlib.Path(marker).write_text(str(e.seq))
        await asyncio.sleep(3600)  # killed -9 here, before the handler returns
    bus.subscribe(ev.NODES, {ev.NodeHeartbeat: hang}, group=group)
    await bus.start()
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_offsets_commit_only_after_success_so_a_crash_redelivers(env: dict, tmp_path) -> None:
    """kill -9 a consumer inside its handler: the same group gets the message again."""
    import signal
    import subprocess
    import sys

    group = f"{env['group_prefix']}.crash"
    marker = tmp_path / "handling"
    bus = await make_bus(env, "producer")
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_CONSUMER, env["kafka_bootstrap"],
                             env["topic_namespace"], group, str(marker)])
    try:
        async with bus:
            await bus.publish(heartbeat(seq=42))
            await wait_until(marker.exists, timeout_s=60)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert marker.read_text() == "42"

    got: list[int] = []

    async def record(e: ev.NodeHeartbeat) -> None:
        got.append(e.seq)

    second = await make_bus(env, "second")
    second.subscribe(ev.NODES, {ev.NodeHeartbeat: record}, group=group)
    async with second:
        await wait_until(lambda: 42 in got, timeout_s=90)
    assert got[0] == 42


# What a plain Kafka client can put on any topic: bodies that are no event, under every header our producers set
# (content-type, the W3C trace context), under headers faststream itself would choke on (bytes that are not
# UTF-8, a null value), and under none.
POISON_BODIES = (b"\x00garbage", b"not json at all", b"{", b"\xff\xfe\xfd", b"[" * 5000, b'{"eventType": 3}', b"")
POISON_HEADERS: tuple[list[tuple[str, bytes | None]], ...] = (
    [],
    [("content-type", b"application/json")],
    [("content-type", b"application/json"), ("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
     ("tracestate", b"ty=1")],
    [("content-type", b"application/json"), ("traceparent", b"garbage")],
    [("content-type", b"text/plain")],
    [("content-type", b"application/json"), ("x-binary", b"\xff\xfe")],
    [("content-type", None)],
)
CONSUMED = tuple(t for t in ev.ALL_TOPICS if t != ev.DEADLETTER)


async def test_poison_under_every_header_is_dead_lettered_on_every_topic_and_each_partition_goes_on(env: dict) -> None:
    from aiokafka import AIOKafkaProducer

    bus = await make_bus(env)
    letters: list[ev.DeadLetter] = []
    beats: list[ev.NodeHeartbeat] = []

    async def ignore(e: ev.Event) -> None:
        pass

    async def on_beat(e: ev.NodeHeartbeat) -> None:
        beats.append(e)

    async def on_letter(e: ev.DeadLetter) -> None:
        letters.append(e)

    for topic in CONSUMED:  # one group reads them all, as a service's consumer does
        bus.subscribe(topic, {ev.NodeHeartbeat: on_beat} if topic == ev.NODES else {ev.DeadLetter: ignore})
    bus.subscribe(ev.DEADLETTER, {ev.DeadLetter: on_letter}, group=f"{env['group_prefix']}.dlq-reader")
    sent: list[tuple[str, bytes]] = []
    producer = AIOKafkaProducer(bootstrap_servers=env["kafka_bootstrap"])
    await producer.start()
    try:
        async with bus:
            for topic in CONSUMED:
                for headers in POISON_HEADERS:
                    for body in POISON_BODIES:
                        # one key: every poison record of a topic on one partition, each behind the one before
                        await producer.send_and_wait(f"{env['topic_namespace']}{topic}", body, key=b"k",
                                                     headers=headers)
                        sent.append((topic, body))
            await bus.publish(heartbeat(node="k", seq=7))  # behind the poison on its partition if it shares one
            await wait_until(lambda: len(letters) >= len(sent) and beats, timeout_s=120)
            assert bus.stuck() == []
    finally:
        await producer.stop()
    got = Counter((dl.source_topic, base64.b64decode(dl.raw_b64)) for dl in letters)
    assert got == Counter(sent)  # each record's own bytes, once per record
    assert all("invalid event" in dl.error for dl in letters)
    assert [b.seq for b in beats] == [7]


async def test_a_partition_held_on_one_record_is_reported_stuck_until_it_moves_on(env: dict) -> None:
    bus = await make_bus(env)
    failing = True
    handled: list[int] = []

    async def on_heartbeat(e: ev.NodeHeartbeat) -> None:
        if failing:
            raise StateStoreError("redis is down (test)")
        handled.append(e.seq)

    bus.subscribe(ev.NODES, {ev.NodeHeartbeat: on_heartbeat},
                  retry=RetryPolicy(initial_interval_s=0.01, maximum_interval_s=0.05), stuck_after=3)
    async with bus:
        await bus.publish(heartbeat(seq=1))
        await wait_until(lambda: bool(bus.stuck()))
        [stuck] = bus.stuck()
        assert (stuck.topic, stuck.tries >= 3) == (ev.NODES, True)
        assert "redis is down" in stuck.error
        failing = False
        await wait_until(lambda: handled == [1])
        assert bus.stuck() == []


async def test_an_idle_consumer_stops_fetching_and_every_record_still_arrives(env: dict, redis) -> None:
    """With idle pausing on (as the local stack runs): a consumer with no record pauses its partitions; a
    record published by a bus with a doorbell wakes it, and one from a plain Kafka client (no doorbell) is
    fetched at the next poll. Nothing is lost, and it pauses again once idle."""
    from aiokafka import AIOKafkaProducer

    from trainyard_runtime.idlefetch import Doorbell, IdlePolicy
    from trainyard_runtime.store import connect_redis

    await ensure_topics(env["kafka_bootstrap"], partitions=2, namespace=env["topic_namespace"])
    redis_url = env["redis_url"]
    clients = [connect_redis(redis_url), connect_redis(redis_url)]

    def idle_bus(name: str, client) -> Bus:
        return Bus(env["kafka_bootstrap"], service_name=name, group_prefix=env["group_prefix"],
                   topic_namespace=env["topic_namespace"], idle=IdlePolicy(pause_s=0.5, poll_s=1.0),
                   doorbell=Doorbell(client))

    consumer, producer = idle_bus("sleeper", clients[0]), idle_bus("ringer", clients[1])
    seen: list[int] = []

    async def on_heartbeat(e: ev.NodeHeartbeat) -> None:
        seen.append(e.seq)

    consumer.subscribe(ev.NODES, {ev.NodeHeartbeat: on_heartbeat})
    plain = AIOKafkaProducer(bootstrap_servers=env["kafka_bootstrap"])
    await plain.start()
    try:
        async with consumer, producer:
            [idle] = consumer._idle
            await wait_until(lambda: idle.paused)
            await producer.publish(heartbeat(seq=1))  # rings the doorbell
            await wait_until(lambda: seen == [1])
            await wait_until(lambda: idle.paused)  # idle again
            await plain.send_and_wait(f"{env['topic_namespace']}{ev.NODES}", heartbeat(seq=2).to_bytes(), key=b"n1")
            await wait_until(lambda: seen == [1, 2])  # no doorbell: the poll fetched it
            for seq in range(3, 13):
                await producer.publish(heartbeat(seq=seq))
            await wait_until(lambda: sorted(seen) == list(range(1, 13)))
    finally:
        await plain.stop()
        for client in clients:
            await client.aclose()
    assert sorted(seen) == list(range(1, 13))


async def test_a_batch_subscription_gets_every_event_in_order_and_fails_only_what_cannot_be_applied(env: dict) -> None:
    """subscribe_batch: every event of the class arrives once a batch handler returns (in each key's order), a
    record that is no event is dead-lettered, a retryable failure hands the batch back whole (nothing skipped),
    and one that is not retryable dead-letters only the event that fails when handled alone."""
    bus = await make_bus(env)
    batches: list[list[int]] = []
    handled: list[int] = []
    tries = Counter[int]()
    letters: list[ev.DeadLetter] = []

    async def on_batch(events: list[ev.NodeHeartbeat]) -> None:
        batches.append([e.seq for e in events])
        for e in events:
            tries[e.seq] += 1
        if any(e.seq == 7 for e in events) and tries[7] < 3:
            raise StateStoreError("redis blinked")  # retryable: the batch again, later
        if any(e.seq == 13 for e in events):
            raise TrainyardError("13 can never be applied")
        handled.extend(e.seq for e in events)

    async def on_letter(e: ev.DeadLetter) -> None:
        letters.append(e)

    bus.subscribe_batch(ev.NODES, ev.NodeHeartbeat, on_batch, group=f"{env['group_prefix']}.batch",
                        retry=RetryPolicy(initial_interval_s=0.05, maximum_interval_s=0.2))
    bus.subscribe(ev.DEADLETTER, {ev.DeadLetter: on_letter}, group=f"{env['group_prefix']}.dlq-reader")
    async with bus:
        for seq in range(1, 21):
            await bus.publish(heartbeat(node=f"n{seq % 3}", seq=seq))
        await bus.publish_raw(ev.NODES, b"\x00not an event", key="n1")
        await wait_until(lambda: set(range(1, 21)) - {13} <= set(handled) and len(letters) >= 2)
        await asyncio.sleep(0.5)  # a duplicate dead letter would arrive meanwhile
    assert 13 not in handled and tries[7] >= 3
    for node in range(3):  # each key's events in their order, within and across batches
        order = [s for s in handled if s % 3 == node]
        assert order == sorted(order)
    errors = sorted(dl.error for dl in letters)  # once each, though the batch with the bad record came back
    assert len(errors) == 2
    assert errors[0].startswith("handler error: TrainyardError") and errors[1].startswith("invalid event")
    assert any(len(b) > 1 for b in batches)  # delivered as batches, not one by one
