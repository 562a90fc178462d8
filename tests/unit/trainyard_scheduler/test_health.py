"""Straggler detection and node reputation: pure decisions over synthetic metrics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from trainyard_contract.errors import ConfigError
from trainyard_scheduler import health as h

T0 = datetime(2025, 1, 1, tzinfo=UTC)
POLICY = h.StragglerPolicy(window_steps=10, factor=1.3, consecutive=2, lag_steps=1)


def feed(detector: h.StragglerDetector, steps: range, compute: dict[int, float], *, job: str = "j",
         attempt: int = 1) -> list[h.Straggler]:
    found: list[h.Straggler] = []
    for step in steps:
        for rank, seconds in compute.items():
            found += detector.observe(job, attempt, rank, step, seconds)
    return found


def test_a_rank_slow_for_k_windows_is_a_straggler() -> None:
    detector = h.StragglerDetector(POLICY)
    compute = {0: 1.0, 1: 1.02, 2: 0.98, 3: 1.5}
    assert feed(detector, range(0, 12), compute) == []  # one slow window is not enough
    (found,) = feed(detector, range(12, 22), compute)  # window 10-19 is judged once step 21 is seen
    assert (found.rank, found.attempt, found.from_step, found.to_step, found.window_steps) == (3, 1, 0, 19, 20)
    assert found.slowdown == pytest.approx(1.5 / 1.0) and found.median_compute_seconds == pytest.approx(1.0)
    assert found.compute_seconds == pytest.approx(1.5)
    assert feed(detector, range(22, 32), compute) == []  # counted again from zero
    assert [s.rank for s in feed(detector, range(32, 42), compute)] == [3]


def test_an_even_gang_or_a_brief_hiccup_is_not_a_straggler() -> None:
    detector = h.StragglerDetector(POLICY)
    assert feed(detector, range(0, 60), {0: 1.0, 1: 1.1, 2: 0.95, 3: 1.2}) == []
    hiccup = h.StragglerDetector(POLICY)
    assert feed(hiccup, range(0, 12), {0: 1.0, 1: 2.0}) == []
    assert feed(hiccup, range(12, 22), {0: 1.0, 1: 1.0}) == []  # streak broken
    assert feed(hiccup, range(22, 32), {0: 1.0, 1: 2.0}) == []


def test_two_ranks_compare_the_slow_one_with_the_fast_one() -> None:
    detector = h.StragglerDetector(POLICY)
    assert [s.rank for s in feed(detector, range(0, 22), {0: 1.0, 1: 1.4})] == [1]


def test_a_new_attempt_starts_afresh_and_late_metrics_of_an_old_one_are_ignored() -> None:
    detector = h.StragglerDetector(POLICY)
    feed(detector, range(0, 12), {0: 1.0, 1: 2.0}, attempt=1)
    assert feed(detector, range(12, 22), {0: 1.0, 1: 2.0}, attempt=2) == []  # streak of attempt 1 not carried
    assert feed(detector, range(0, 40), {0: 1.0, 1: 5.0}, attempt=1) == []


def test_memory_is_bounded_by_max_jobs() -> None:
    detector = h.StragglerDetector(h.StragglerPolicy(window_steps=10, max_jobs=3))
    for n in range(10):
        detector.observe(f"job-{n}", 1, 0, 1, 1.0)
    assert len(detector._jobs) == 3


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ConfigError, match="factor"):
        h.StragglerPolicy(factor=0.9)
    with pytest.raises(ConfigError, match="reinstate_below"):
        h.ReputationPolicy(quarantine_at=1.0, reinstate_below=2.0)


REP = h.ReputationPolicy(half_life_s=3600, quarantine_at=3.0, reinstate_below=1.0)


def test_scores_halve_every_half_life() -> None:
    score = h.add(None, 2.0, T0, REP)
    assert h.decayed(score, T0, REP) == 2.0
    assert h.decayed(score, T0 + timedelta(hours=1), REP) == pytest.approx(1.0)
    assert h.decayed(score, T0 + timedelta(hours=3), REP) == pytest.approx(0.25)
    later = h.add(score, 1.0, T0 + timedelta(hours=1), REP)
    assert later.score == pytest.approx(2.0) and later.at == T0 + timedelta(hours=1)
    assert h.decayed(None, T0, REP) == 0.0


@pytest.mark.parametrize(("reason", "weight"), [
    ("lost", 1.0), ("nccl", 1.0), ("hang", 1.0), ("signal-11", 1.0), ("signal", 1.0), ("oom", 0.5),
    ("killed", 0.5), ("error", 0.0), ("config", 0.0), ("data", 0.0), ("nan", 0.0), ("preempted", 0.0),
])
def test_only_node_reasons_count(reason: str, weight: float) -> None:
    assert REP.weight(reason) == weight


def test_quarantine_at_the_threshold_and_back_after_decay() -> None:
    score = None
    for _ in range(3):
        score = h.add(score, REP.weight("nccl"), T0, REP)
    assert h.should_quarantine(score.score, False, REP) and not h.should_quarantine(score.score, True, REP)
    until = h.quarantine_until(score.score, T0, REP)
    assert until == T0 + timedelta(seconds=3600 * 1.584962500721156)  # log2(3) half-lives
    assert not h.should_reinstate(h.decayed(score, until - timedelta(seconds=60), REP), "reputation", REP)
    assert h.should_reinstate(h.decayed(score, until + timedelta(seconds=60), REP), "reputation", REP)
    assert not h.should_reinstate(0.0, "admin-alice", REP)  # an admin's quarantine waits for an admin
    assert h.quarantine_until(0.5, T0, REP) == T0


def test_one_tenant_failing_on_purpose_cannot_quarantine_a_node_alone() -> None:
    """What a tenant's ranks report (a signal, a hang, NCCL markers, slow steps) counts up to its cap; a second
    tenant's failures count on top; a node going silent (no tenant) is never capped."""
    score = None
    for _ in range(10):  # hang after hang, SIGSEGV after SIGSEGV: 10.0 uncapped
        score = h.add(score, REP.weight("hang"), T0, REP, "attacker")
    assert score.score == pytest.approx(1.5) and dict(score.tenants) == {"attacker": pytest.approx(1.5)}
    assert not h.should_quarantine(score.score, False, REP)
    score = h.add(score, REP.weight("nccl"), T0, REP, "another")  # a second tenant sees the node fail too
    score = h.add(score, REP.weight("nccl"), T0, REP, "another")
    assert score.score == pytest.approx(3.0) and h.should_quarantine(score.score, False, REP)
    silent = h.add(None, 1.0, T0, REP)  # lost: the node's own silence
    for _ in range(2):
        silent = h.add(silent, 1.0, T0, REP)
    assert silent.score == 3.0 and silent.tenants == {}


def test_a_tenants_share_decays_with_the_score_and_the_record_round_trips() -> None:
    score = h.add(None, 1.0, T0, REP, "t1")
    score = h.add(score, 1.0, T0, REP, "t1")  # capped at 1.5
    later = h.add(score, 1.0, T0 + timedelta(hours=1), REP, "t1")  # 0.75 left of its share: 0.75 more fits
    assert later.score == pytest.approx(1.5) and later.tenants["t1"] == pytest.approx(1.5)
    assert h.NodeScore.from_dict(later.to_dict()) == later
    old = h.NodeScore.from_dict({"score": 2.0, "at": T0.isoformat()})  # written before the field existed
    assert old.tenants == {} and h.add(old, 1.0, T0, REP, "t1").score == 3.0
    uncapped = h.ReputationPolicy(half_life_s=3600, quarantine_at=3.0, reinstate_below=1.0, per_tenant_cap=None)
    assert h.add(h.add(h.add(None, 1.0, T0, uncapped, "t1"), 1.0, T0, uncapped, "t1"), 1.0, T0, uncapped,
                 "t1").score == 3.0


def test_a_quarantine_is_recorded_the_same_way_whoever_decided_it() -> None:
    from trainyard_contract.events import NodeQuarantined

    at = T0
    by_score = NodeQuarantined(node_id="n1", reason="failure score 3.10", score=3.1, until=at, by="reputation",
                               occurred_at=at)
    assert h.quarantine_entry(by_score) == {"reason": "failure score 3.10", "by": "reputation", "score": 3.1,
                                                 "until": at.isoformat(), "at": at.isoformat()}
    by_hand = NodeQuarantined(node_id="n1", reason="bad DIMM", occurred_at=at)
    assert h.quarantine_entry(by_hand) == {"reason": "bad DIMM", "by": "admin", "score": None, "until": None,
                                                "at": at.isoformat()}


def test_a_batch_of_heartbeats_folds_to_each_nodes_latest_but_keeps_a_change_of_state() -> None:
    from datetime import timedelta

    from trainyard_contract.events import DeviceInfo, NodeHeartbeat, utcnow
    from trainyard_scheduler.node_health import fold_heartbeats

    t0 = utcnow()

    def beat(node: str, s: float, *, draining: bool = False, boot: str = "b1") -> NodeHeartbeat:
        return NodeHeartbeat(node_id=node, host="h", devices=[DeviceInfo(index=0, type="cpu", memory_bytes=1)],
                             occurred_at=t0 + timedelta(seconds=s), draining=draining, boot_id=boot)

    a1, a2, b1, a3 = beat("a", 1), beat("a", 2), beat("b", 1), beat("a", 3, draining=True)
    late = beat("b", 0.5)  # delivered after a newer one of its node
    folded = fold_heartbeats([a1, b1, a2, late, a3])
    assert folded == [a2, a3, b1]  # a's last routine one before its drain, then the drain; b's newest
    assert fold_heartbeats([]) == []
