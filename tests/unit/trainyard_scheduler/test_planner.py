"""One scheduling pass: priority then submission order, placements taken out as it goes, wait reasons."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from trainyard_common.events import DeviceInfo
from trainyard_scheduler.placement import ClusterSnapshot, GangRequest, NodeView
from trainyard_scheduler.planner import Admit, PendingJob, Wait, order, plan

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def node(node_id: str, count: int = 4, leased: tuple[int, ...] = ()) -> NodeView:
    devices = tuple(DeviceInfo(index=i, type="cpu", memory_bytes=0) for i in range(count))
    return NodeView(node_id, f"{node_id}.local", devices, frozenset(leased))


def job(job_id: str, count: int, *, priority: int = 0, at: int = 0, not_before: int | None = None,
        tensor: int = 1) -> PendingJob:
    return PendingJob(
        job_id=job_id, request=GangRequest("cpu", count, tensor), submitted_at=T0 + timedelta(seconds=at),
        priority=priority, not_before=None if not_before is None else T0 + timedelta(seconds=not_before),
    )


def summary(decisions: list) -> list[tuple[str, str]]:
    return [(d.job_id, "admit" if isinstance(d, Admit) else f"wait: {d.reason}") for d in decisions]


def test_order_is_priority_then_submission_then_id() -> None:
    pending = [job("c", 1, at=5), job("b", 1, priority=10, at=9), job("a", 1, at=5), job("d", 1, at=1)]
    assert [p.job_id for p in order(pending)] == ["b", "d", "a", "c"]


def test_admits_in_order_until_capacity_runs_out() -> None:
    snapshot = ClusterSnapshot((node("n1"), node("n2")))
    decisions = plan(snapshot, [job("late", 4, at=2), job("early", 6, at=1), job("small", 2, at=3)], T0)
    assert summary(decisions) == [
        ("early", "admit"),
        ("late", "wait: waiting for 4 free cpu devices (2 free)"),
        ("small", "admit"),  # best-effort FIFO: a blocked job does not stall smaller ones behind it
    ]
    placed = [d for d in decisions if isinstance(d, Admit)]
    used = [str(dev) for d in placed for dev in d.placement.devices()]
    assert len(used) == len(set(used)) == 8  # no device handed out twice in one pass


def test_higher_priority_wins_the_last_devices() -> None:
    snapshot = ClusterSnapshot((node("n1", leased=(0, 1)),))
    decisions = plan(snapshot, [job("old", 2, at=0), job("urgent", 2, priority=5, at=10)], T0)
    assert summary(decisions) == [("urgent", "admit"), ("old", "wait: waiting for 2 free cpu devices (0 free)")]


def test_oversized_job_waits_with_a_reason_and_blocks_nothing() -> None:
    snapshot = ClusterSnapshot((node("n1"), node("n2")))
    decisions = plan(snapshot, [job("huge", 16, at=0), job("ok", 4, at=1)], T0)
    assert summary(decisions) == [
        ("huge", "wait: needs 16 cpu devices; the cluster has 8 healthy cpu devices on 2 nodes"),
        ("ok", "admit"),
    ]
    assert isinstance(decisions[0], Wait) and decisions[0].fits_when_idle is False


def test_back_off_keeps_the_recorded_reason() -> None:
    snapshot = ClusterSnapshot((node("n1"),))
    decisions = plan(snapshot, [job("retry", 2, not_before=30), job("next", 4, at=1)], T0)
    assert decisions[0] == Wait("retry", None)
    assert summary(decisions)[1] == ("next", "admit")  # the backing-off job does not hold devices
    later = plan(snapshot, [job("retry", 2, not_before=30)], T0 + timedelta(seconds=31))
    assert summary(later) == [("retry", "admit")]


def test_empty_queue_plans_nothing() -> None:
    assert plan(ClusterSnapshot((node("n1"),)), [], T0) == []
