"""Scheduler settings: defaults that make HA work, and combinations that cannot."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainyard_scheduler.settings import SchedulerSettings


def test_defaults_let_a_standby_take_over_within_seconds() -> None:
    settings = SchedulerSettings()
    assert settings.leader_ttl_s <= 5 and settings.tick_s <= 1
    assert settings.lease_ttl_s > settings.node_timeout_s  # leases outlive the node timeout
    assert settings.queue_config is None and settings.admit_pause_s == 0


@pytest.mark.parametrize("overrides", [
    {"lease_ttl_s": 10, "node_timeout_s": 15},
    {"rendezvous_port_min": 30000, "rendezvous_port_max": 29999},
    {"republish_after_s": 120, "start_timeout_s": 120},  # re-publishing must come before the start time-out
    {"quarantine_score": 1.0, "reinstate_score": 2.0},
    {"straggler_factor": 1.0},
    {"quarantine_max_share": 0},  # automatic quarantine could take nothing: use a share > 0
    {"quarantine_max_share": 1.5},
    {"silent_cluster_share": 0},  # any single silent node would be a control-plane outage
])
def test_impossible_combinations_are_refused(overrides: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        SchedulerSettings(**overrides)


def test_lease_ttl_zero_means_no_expiry() -> None:
    assert SchedulerSettings(lease_ttl_s=0).lease_ttl_s == 0


def test_failure_handling_defaults() -> None:
    settings = SchedulerSettings()
    assert settings.republish_after_s < settings.start_timeout_s and settings.republish_max >= 1
    assert settings.max_total_failures is None  # only failures without progress are budgeted by default
    assert settings.reinstate_score < settings.quarantine_score and settings.pause_grace_s > 0


def test_automatic_quarantine_and_silence_default_to_half_the_cluster() -> None:
    settings = SchedulerSettings()
    assert settings.quarantine_max_share == 0.5 and settings.silent_cluster_share == 0.5


def test_fault_injection_wraps_the_leases_only_when_asked() -> None:
    from redis.asyncio import Redis
    from trainyard_scheduler.faults import PauseAfterGrant, with_faults
    from trainyard_scheduler.fencing import FencedLeases

    leases = FencedLeases(Redis(), ttl_ms=5)  # a client that never connects: the leases are only wrapped
    assert with_faults(leases, admit_pause_s=0) is leases
    paused = with_faults(leases, admit_pause_s=2.5)
    assert isinstance(paused, PauseAfterGrant) and paused.pause_s == 2.5 and paused.ttl_ms == 5
