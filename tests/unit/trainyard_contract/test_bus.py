"""The bus's pure parts: which partitions count as stuck, and the decoder that leaves the bytes to us."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainyard_runtime.bus import Redelivery, StuckPartition, _body_bytes, _Failing, stuck_partitions
from trainyard_runtime.retry import RetryPolicy

# forgotten after 3 * 1 + 30 = 33 s
POLICY = Redelivery(RetryPolicy(initial_interval_s=0.1, maximum_interval_s=1.0), stuck_after=3)


@pytest.mark.parametrize(("tries", "last_at", "stuck"), [
    (1, 100.0, False),    # one failure: retrying, not stuck
    (2, 100.0, False),
    (3, 100.0, True),     # the policy's stuck_after
    (9, 100.0, True),
    (9, 100.0 - 33.0, True),   # the last try just within the window
    (9, 100.0 - 33.5, False),  # no try seen for longer: moved to another consumer
])
def test_a_partition_is_stuck_after_its_policys_tries_while_tries_keep_coming(tries: int, last_at: float,
                                                                               stuck: bool) -> None:
    failing = {("trainyard.jobs", 1, 42): _Failing(tries, 50.0, last_at, "RedisError: down")}
    got = stuck_partitions("g", failing, {"trainyard.jobs": POLICY}, now=100.0)
    assert got == ([StuckPartition("g", "trainyard.jobs", 1, 42, tries, 50.0, "RedisError: down")] if stuck else [])


def test_each_topic_is_judged_by_its_own_policy() -> None:
    failing = {("a", 0, 1): _Failing(3, 0.0, 99.0, "x"), ("b", 0, 1): _Failing(3, 0.0, 99.0, "x")}
    got = stuck_partitions("g", failing, {"a": POLICY, "b": Redelivery(stuck_after=4)}, now=100.0)
    assert [s.topic for s in got] == ["a"]


@pytest.mark.parametrize("content_type", [None, "application/json", "text/plain", "application/octet-stream"])
@pytest.mark.parametrize("body", [b"\x00garbage", b"{", b"\xff\xfe", b'{"eventType":"NodeHeartbeat"}'])
def test_the_decoder_hands_over_the_bytes_whatever_the_content_type(content_type: str | None, body: bytes) -> None:
    assert _body_bytes(SimpleNamespace(body=body, content_type=content_type)) == body
