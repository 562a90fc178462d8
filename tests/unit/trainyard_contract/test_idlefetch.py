"""Idle fetching's decision, table-driven, and the controller over a stand-in consumer (pure logic)."""

from __future__ import annotations

import pytest

from trainyard_runtime.idlefetch import POLL_AWAKE_S, IdleFetching, IdlePolicy, IdleState, next_action

POLICY = IdlePolicy(pause_s=3.0, poll_s=2.0)


@pytest.mark.parametrize(("state", "now", "want"), [
    (IdleState(awake_until=10.0), 9.0, ("wait", 1.0)),                      # awake: until its time runs out
    (IdleState(awake_until=10.0), 10.0, ("pause", 2.0)),                    # then pause, look again in poll_s
    (IdleState(awake_until=10.0, rung=True), 9.0, ("wait", 1.0)),           # a ring while awake changes nothing
    (IdleState(awake_until=0.0, paused_at=10.0), 11.0, ("wait", 1.0)),      # paused: until the poll
    (IdleState(awake_until=0.0, paused_at=10.0), 12.0, ("resume", POLL_AWAKE_S)),  # the poll
    (IdleState(awake_until=0.0, paused_at=10.0, rung=True), 10.1, ("resume", POLL_AWAKE_S)),  # a ring: at once
])
def test_next_action(state: IdleState, now: float, want: tuple[str, float]) -> None:
    action, wait_s = next_action(state, now, POLICY)
    assert (action, round(wait_s, 6)) == want


class FakeConsumer:
    def __init__(self, tps: set[str]) -> None:
        self.tps, self.paused = tps, set()

    def assignment(self) -> set[str]:
        return set(self.tps)

    def pause(self, *tps: str) -> None:
        self.paused |= set(tps)

    def resume(self, *tps: str) -> None:
        self.paused -= set(tps)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_controller_pauses_what_is_assigned_leaves_retry_pauses_alone_and_wakes_on_its_topics_ring() -> None:
    clock, consumer = Clock(), FakeConsumer({"a-0", "a-1", "b-0"})
    idle = IdleFetching(frozenset({"a", "b"}), consumer=lambda: consumer, policy=POLICY, retry_paused={"a-1"},
                        clock=clock)
    consumer.paused = {"a-1"}  # the retry back-off's
    clock.t += 3.0
    idle._pause()
    assert idle.paused and consumer.paused == {"a-0", "a-1", "b-0"}
    idle.ring("other-topic")  # not one of its topics
    assert next_action(idle.state, clock(), POLICY)[0] == "wait"
    idle.ring("b")
    assert next_action(idle.state, clock(), POLICY)[0] == "resume"
    idle._resume(rung=True)
    assert not idle.paused and consumer.paused == {"a-1"}  # the back-off's pause stays
    assert idle.state.awake_until == clock() + POLICY.pause_s  # a ring keeps it awake for pause_s


def test_a_record_keeps_it_awake_and_a_poll_resumes_it_only_briefly() -> None:
    clock, consumer = Clock(), FakeConsumer({"a-0"})
    idle = IdleFetching(frozenset({"a"}), consumer=lambda: consumer, policy=POLICY, clock=clock)
    clock.t += 2.0
    idle.saw_record()
    clock.t += 2.0
    assert next_action(idle.state, clock(), POLICY)[0] == "wait"  # 2 s after a record: still awake
    clock.t += 1.0
    assert next_action(idle.state, clock(), POLICY)[0] == "pause"
    idle._pause()
    clock.t += POLICY.poll_s
    assert next_action(idle.state, clock(), POLICY)[0] == "resume"
    idle._resume(rung=False)
    assert idle.state.awake_until == clock() + POLL_AWAKE_S


def test_without_a_consumer_yet_nothing_is_paused() -> None:
    clock = Clock()
    idle = IdleFetching(frozenset({"a"}), consumer=lambda: None, policy=POLICY, clock=clock)
    clock.t += 5.0
    idle._pause()
    assert not idle.paused
