"""One scheduling pass: order (priority, aging, fair share), quotas, reservations and backfill,
preemption, and the reason every waiting job gives."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from trainyard_contract.devices import Device
from trainyard_contract.events import DeviceInfo
from trainyard_scheduler.gang import GangRequest, Placement
from trainyard_scheduler.placement import place
from trainyard_scheduler.planner import (
    Admit,
    PendingJob,
    PlanStats,
    Preempt,
    RunningJob,
    Wait,
    order,
    plan,
)
from trainyard_scheduler.policy import QueueConfig
from trainyard_scheduler.topology import ClusterSnapshot, NodeView

T0 = datetime(2025, 1, 1, tzinfo=UTC)
H100 = "h100"


def node(node_id: str, count: int = 4, leased: tuple[int, ...] = (), *, kind: str = "cpu",
         rack: str | None = None) -> NodeView:
    devices = tuple(DeviceInfo(index=i, type=kind, memory_bytes=0) for i in range(count))
    return NodeView(node_id, f"{node_id}.local", devices, frozenset(leased), rack=rack)


def job(job_id: str, count: int, *, priority: int = 0, at: float = 0, not_before: int | None = None,
        tensor: int = 1, tenant: str = "t1", kind: str = "cpu", duration: float | None = None,
        preempting: tuple[str, ...] = ()) -> PendingJob:
    return PendingJob(
        job_id=job_id, request=GangRequest(kind, count, tensor), submitted_at=T0 + timedelta(seconds=at),
        priority=priority, not_before=None if not_before is None else T0 + timedelta(seconds=not_before),
        tenant=tenant, expected_duration_s=duration, preempting=preempting,
    )


def running(job_id: str, devices: list[str], *, priority: int = 0, tenant: str = "t1", kind: str = "cpu",
            started: float = -3600, ends: float | None = None, preempted_by: str | None = None,
            admitted_priority: int | None = None) -> RunningJob:
    return RunningJob(job_id, tenant, priority, kind, tuple(Device(*d.split(":")[:1], int(d.split(":")[1]))
                                                             for d in devices),
                      T0 + timedelta(seconds=started), None if ends is None else T0 + timedelta(seconds=ends),
                      preempted_by, admitted_priority)


def snapshot_with(nodes: list[NodeView], *busy: RunningJob) -> ClusterSnapshot:
    snap = ClusterSnapshot(nodes)
    for r in busy:
        snap.take_devices(r.gpu_type, r.devices)
    return snap


def summary(decisions: list) -> list[tuple[str, str]]:
    out = []
    for d in decisions:
        if isinstance(d, Admit):
            out.append((d.job_id, "backfill" if d.backfill else "admit"))
        elif isinstance(d, Preempt):
            out.append((d.job_id, f"preempt {','.join(d.victims)}"))
        else:
            out.append((d.job_id, f"{d.kind}" if d.reason is None else f"{d.reason}"))
    return out


def kinds(decisions: list) -> dict[str, str]:
    return {d.job_id: d.kind for d in decisions if isinstance(d, Wait)}


def config(**data: object) -> QueueConfig:
    return QueueConfig.model_validate(data)


# ----------------------------------------------------------------------------- order


def test_order_is_effective_priority_then_submission_then_id() -> None:
    pending = [job("c", 1, at=5), job("b", 1, priority=10, at=9), job("a", 1, at=5), job("d", 1, at=1)]
    assert [p.job_id for p in order(pending)] == ["b", "d", "a", "c"]
    aged = config(aging={"everySeconds": 3600, "step": 10})
    now = T0 + timedelta(hours=3)
    old_low = job("old-low", 1, priority=-20, at=0)  # waited 3 h: -20 + 30 = 10
    fresh = job("fresh", 1, priority=5, at=3 * 3600 - 1)
    assert [p.job_id for p in order([fresh, old_low], aged, now)] == ["old-low", "fresh"]


def test_admits_in_order_and_holds_the_rest_for_the_head() -> None:
    snapshot = ClusterSnapshot((node("n1"), node("n2")))
    decisions = plan(snapshot, [job("late", 4, at=2), job("early", 6, at=1), job("small", 2, at=3)], T0)
    assert summary(decisions)[0] == ("early", "admit")
    assert summary(decisions)[1][0] == "late"
    assert summary(decisions)[1][1].startswith("capacity: waiting for 4 free cpu devices (2 free); next in line")
    # "small" would fit in the 2 free devices, but they are held for "late", which is ahead of it
    assert kinds(decisions)["small"] == "priority"
    placed = [d for d in decisions if isinstance(d, Admit)]
    assert len({str(dev) for d in placed for dev in d.placement.devices()}) == 6
    assert snapshot.free_devices("cpu") == 2  # the admitted gang is taken; the hold is undone


def test_without_backfill_reservations_a_blocked_job_blocks_nothing() -> None:
    snapshot = ClusterSnapshot((node("n1"), node("n2")))
    decisions = plan(snapshot, [job("late", 4, at=2), job("early", 6, at=1), job("small", 2, at=3)], T0,
                     policy=config(backfill=False))
    assert summary(decisions) == [("early", "admit"), ("late", "capacity: waiting for 4 free cpu devices (2 free)"),
                                  ("small", "admit")]


def test_higher_priority_wins_the_last_devices() -> None:
    snapshot = ClusterSnapshot((node("n1", leased=(0, 1)),))
    decisions = plan(snapshot, [job("old", 2, at=0), job("urgent", 2, priority=5, at=10)], T0)
    assert summary(decisions)[0] == ("urgent", "admit")
    assert kinds(decisions)["old"] == "capacity"


def test_a_job_that_never_fits_waits_with_a_reason_and_reserves_nothing() -> None:
    snapshot = ClusterSnapshot((node("n1"), node("n2")))
    decisions = plan(snapshot, [job("huge", 16, at=0), job("ok", 4, at=1)], T0)
    assert summary(decisions) == [
        ("huge", "capacity: needs 16 cpu devices; the cluster has 8 healthy cpu devices on 2 nodes"),
        ("ok", "admit"),
    ]
    assert isinstance(decisions[0], Wait) and decisions[0].fits_when_idle is False


def test_back_off_keeps_the_recorded_reason() -> None:
    snapshot = ClusterSnapshot((node("n1"),))
    decisions = plan(snapshot, [job("retry", 2, not_before=30), job("next", 4, at=1)], T0)
    assert decisions[0] == Wait("retry", None, True, "backoff")
    assert summary(decisions)[1] == ("next", "admit")  # the backing-off job does not hold devices
    later = plan(ClusterSnapshot((node("n1"),)), [job("retry", 2, not_before=30)], T0 + timedelta(seconds=31))
    assert summary(later) == [("retry", "admit")]


def test_empty_queue_plans_nothing() -> None:
    assert plan(ClusterSnapshot((node("n1"),)), [], T0) == []


# ----------------------------------------------------------------------------- fairness and quotas


def test_fair_share_interleaves_tenants_of_equal_priority() -> None:
    snapshot = ClusterSnapshot([node(f"n{i}") for i in range(4)])
    pending = [job(f"a{i}", 4, tenant="a", at=i) for i in range(4)] + \
              [job(f"b{i}", 4, tenant="b", at=100 + i) for i in range(4)]
    decisions = plan(snapshot, pending, T0, policy=config(backfill=False))
    assert [d.job_id for d in decisions if isinstance(d, Admit)] == ["a0", "b0", "a1", "b1"]


def test_fair_share_weights() -> None:
    snapshot = ClusterSnapshot([node(f"n{i}") for i in range(6)])
    pending = [job(f"a{i}", 4, tenant="a", at=i) for i in range(6)] + \
              [job(f"b{i}", 4, tenant="b", at=100 + i) for i in range(6)]
    decisions = plan(snapshot, pending, T0, policy=config(backfill=False, tenants={"b": {"weight": 2}}))
    admitted = [d.job_id for d in decisions if isinstance(d, Admit)]
    assert sorted(admitted) == ["a0", "a1", "b0", "b1", "b2", "b3"]


def test_quota_caps_a_tenant_at_guaranteed_plus_borrowable() -> None:
    snapshot = ClusterSnapshot([node(f"n{i}") for i in range(4)])
    policy = config(backfill=False, tenants={"t1": {"quotas": {"cpu": {"guaranteed": 4, "borrowLimit": 4}}}})
    decisions = plan(snapshot, [job(f"j{i}", 4, at=i) for i in range(3)], T0, policy=policy)
    assert summary(decisions)[:2] == [("j0", "admit"), ("j1", "admit")]
    assert summary(decisions)[2] == ("j2", "quota: tenant t1 holds 8 cpu devices and may hold 8 "
                                           "(4 guaranteed + 4 borrowable); this job needs 4 more")
    assert kinds(decisions)["j2"] == "quota"


def test_cohort_limit_caps_its_members_together() -> None:
    snapshot = ClusterSnapshot([node(f"n{i}") for i in range(4)])
    policy = config(backfill=False, tenants={"a": {"cohort": "lab"}, "b": {"cohort": "lab"}},
                    cohorts={"lab": {"limits": {"cpu": 8}}})
    decisions = plan(snapshot, [job("a0", 4, tenant="a"), job("b0", 4, tenant="b", at=1),
                                job("a1", 4, tenant="a", at=2), job("c0", 4, tenant="c", at=3)], T0, policy=policy)
    assert kinds(decisions) == {"a1": "quota"}
    assert "cohort lab holds 8 cpu devices of its limit 8" in dict(summary(decisions))["a1"]
    assert {d.job_id for d in decisions if isinstance(d, Admit)} == {"a0", "b0", "c0"}


# ----------------------------------------------------------------------------- backfill


def test_backfill_only_when_it_ends_before_the_heads_reserved_start() -> None:
    nodes = [node("n1"), node("n2")]
    busy = running("r", ["n1:0", "n1:1", "n1:2", "n1:3"], ends=100)
    head = job("head", 8, at=0)
    short = job("short", 2, at=1, duration=50)
    long = job("long", 2, at=2, duration=500)
    stats = PlanStats()
    decisions = plan(snapshot_with(nodes, busy), [head, short, long], T0, running=[busy], stats=stats)
    assert summary(decisions)[1] == ("short", "backfill")
    assert kinds(decisions) == {"head": "capacity", "long": "priority"}
    assert "held for head, which is ahead in the queue; it should start by 2025-01-01T00:01:40" in \
        dict(summary(decisions))["long"]
    (reservation,) = stats.reservations
    assert reservation.job_id == "head" and reservation.start == T0 + timedelta(seconds=100)
    assert {str(d) for d in reservation.devices} == {"n2:0", "n2:1", "n2:2", "n2:3"}


def test_the_reservation_goes_where_the_head_starts_soonest() -> None:
    nodes = [node("a1", rack="ra"), node("a2", rack="ra"), node("b1", rack="rb"), node("b2", rack="rb")]
    slow = running("slow", ["a1:0", "a1:1", "a1:2", "a1:3"], ends=1000)
    quick = running("quick", ["b1:0", "b1:1", "b1:2", "b1:3"], ends=10)
    other = job("other", 4, at=1)  # takes a whole node first: only one node is left free
    stats = PlanStats()
    plan(snapshot_with(nodes, slow, quick), [job("head", 8, at=2), other], T0, running=[slow, quick],
         stats=stats, policy=config(tenants={}))
    (reservation,) = stats.reservations
    assert reservation.where == "rack rb" and reservation.start == T0 + timedelta(seconds=10)


# ----------------------------------------------------------------------------- preemption


def test_a_higher_priority_job_preempts_lower_priority_work_of_its_tenant() -> None:
    nodes = [node("n1"), node("n2")]
    low = running("low", ["n1:0", "n1:1", "n1:2", "n1:3"], priority=-10)
    normal = running("normal", ["n2:0", "n2:1", "n2:2", "n2:3"], priority=0)
    decisions = plan(snapshot_with(nodes, low, normal), [job("urgent", 4, priority=100)], T0,
                     running=[low, normal])
    assert summary(decisions) == [("urgent", "preempt low"),
                                  ("urgent", "preemption: waiting for low to checkpoint and stop (lower priority)")]
    assert kinds(decisions) == {"urgent": "preemption"}


def test_a_preemption_in_progress_holds_what_it_frees_for_the_preemptor() -> None:
    nodes = [node("n1"), node("n2", leased=(0, 1, 2, 3))]
    low = running("low", ["n1:0", "n1:1"], priority=-10, preempted_by="urgent")
    snapshot = snapshot_with(nodes, low)
    decisions = plan(snapshot, [job("urgent", 4, priority=100, preempting=("low",)), job("filler", 2, at=5)], T0,
                     running=[low])
    assert summary(decisions)[0] == ("urgent", "preemption: waiting for low to checkpoint and stop "
                                               "(preempted for this job)")
    assert kinds(decisions)["filler"] == "priority"  # n1's other free devices are held for urgent
    assert snapshot.free_devices("cpu") == 2  # holds undone after the pass


def test_no_preemption_of_equal_priority_young_or_aged_jobs() -> None:
    nodes = [node("n1")]
    cases = [
        running("peer", ["n1:0", "n1:1", "n1:2", "n1:3"], priority=100),
        running("young", ["n1:0", "n1:1", "n1:2", "n1:3"], priority=0, started=-60),  # < minRuntimeSeconds
        running("aged", ["n1:0", "n1:1", "n1:2", "n1:3"], priority=0, admitted_priority=100),
    ]
    for busy in cases:
        decisions = plan(snapshot_with(nodes, busy), [job("urgent", 4, priority=100)], T0, running=[busy])
        assert not [d for d in decisions if isinstance(d, Preempt)], busy.job_id
        assert kinds(decisions) == {"urgent": "capacity"}


def test_guaranteed_quota_is_reclaimed_from_a_borrowing_tenant_only() -> None:
    policy = config(tenants={"a": {"quotas": {"cpu": {"guaranteed": 4}}},
                             "b": {"quotas": {"cpu": {"guaranteed": 4}}}})
    nodes = [node("n1"), node("n2")]
    # a borrows: it holds 8 with 4 guaranteed; b wants its 4 back, at a lower priority even.
    a1 = running("a1", ["n1:0", "n1:1", "n1:2", "n1:3"], tenant="a", priority=10, started=-7200)
    a2 = running("a2", ["n2:0", "n2:1", "n2:2", "n2:3"], tenant="a", priority=10, started=-3600)
    decisions = plan(snapshot_with(nodes, a1, a2), [job("b1", 4, tenant="b", priority=0)], T0,
                     running=[a1, a2], policy=policy)
    assert summary(decisions)[0] == ("b1", "preempt a2")  # the most recently started
    assert "borrowed capacity reclaimed" in dict(summary(decisions))["b1"]
    # a within its guarantee is safe from b
    b_busy = running("b0", ["n2:0", "n2:1", "n2:2", "n2:3"], tenant="b", priority=50)
    decisions = plan(snapshot_with(nodes, a1, b_busy), [job("b1", 4, tenant="b", priority=50)], T0,
                     running=[a1, b_busy], policy=policy)
    assert not [d for d in decisions if isinstance(d, Preempt)]


def test_a_quota_blocked_job_preempts_its_own_lower_priority_work() -> None:
    policy = config(tenants={"t1": {"quotas": {"cpu": {"guaranteed": 4, "borrowLimit": 0}}}})
    nodes = [node("n1"), node("n2")]
    mine = running("mine", ["n1:0", "n1:1", "n1:2", "n1:3"], priority=-5)
    decisions = plan(snapshot_with(nodes, mine), [job("urgent", 4, priority=50)], T0, running=[mine],
                     policy=policy)
    assert summary(decisions)[0] == ("urgent", "preempt mine")


def test_victims_are_chosen_inside_one_rack() -> None:
    h = "h100"
    nodes = [node(f"{r}{i}", 8, kind=h, rack=r) for r in ("ra", "rb") for i in range(2)]
    # ra: two low-priority jobs; rb: a low job and a normal one. The gang needs 16 = one rack.
    v = [running("ra-low0", [f"ra0:{i}" for i in range(8)], priority=-10, kind=h, started=-100_000),
         running("ra-low1", [f"ra1:{i}" for i in range(8)], priority=-10, kind=h, started=-100_000),
         running("rb-low", [f"rb0:{i}" for i in range(8)], priority=-10, kind=h, started=-10_000),
         running("rb-mid", [f"rb1:{i}" for i in range(8)], priority=0, kind=h, started=-10_000)]
    decisions = plan(snapshot_with(nodes, *v), [job("big", 16, priority=100, kind=h, tensor=8)], T0, running=v)
    (preempt,) = [d for d in decisions if isinstance(d, Preempt)]
    assert sorted(preempt.victims) == ["ra-low0", "ra-low1"]  # rb would cost a priority-0 victim


def test_stats_time_each_decision() -> None:
    stats = PlanStats()
    ticks = iter(range(100))
    plan(ClusterSnapshot((node("n1"),)), [job("a", 2), job("b", 4, at=1)], T0, stats=stats,
         timer=lambda: float(next(ticks)))
    assert stats.latencies == [1.0, 1.0] and stats.admit_latencies == [1.0]


def test_a_placer_can_be_swapped() -> None:
    calls = []

    def spy(snapshot: ClusterSnapshot, request: GangRequest) -> Placement:
        calls.append(request.gpu_count)
        result = place(snapshot, request)
        assert isinstance(result, Placement)
        return result

    decisions = plan(ClusterSnapshot((node("n1"),)), [job("a", 2)], T0, placer=spy)
    assert calls == [2] and summary(decisions) == [("a", "admit")]
