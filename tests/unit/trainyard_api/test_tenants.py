"""Tenant settings merge (pure): a PATCH changes only the fields it sends; a null quota is removed; the result
is what the scheduler's TenantConfig reads."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from trainyard_api.bodies import TenantSettingsBody, TokenCreateBody
from trainyard_api.tenants import expiry_of, merged_settings
from trainyard_scheduler.policy import TenantConfig

NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)


def test_a_patch_changes_only_what_it_sends() -> None:
    current = {"cohort": "lab", "weight": 2.0, "maxPriority": 100, "quotas": {"cpu": {"guaranteed": 4}}}
    change = TenantSettingsBody.model_validate({"quotas": {"gpu": {"guaranteed": 1, "borrowLimit": 2}}})
    merged = merged_settings(current, change)
    assert merged == {"cohort": "lab", "weight": 2.0, "maxPriority": 100,
                      "quotas": {"cpu": {"guaranteed": 4, "borrowLimit": None},
                                 "gpu": {"guaranteed": 1, "borrowLimit": 2}}}
    TenantConfig.model_validate(merged)  # the scheduler reads it as is


def test_null_removes_a_quota_and_resets_a_field() -> None:
    current = {"weight": 3.0, "maxPriority": 10, "quotas": {"cpu": {"guaranteed": 4}}}
    change = TenantSettingsBody.model_validate({"quotas": {"cpu": None}, "maxPriority": None, "weight": None})
    assert merged_settings(current, change) == {"cohort": "default", "weight": 1.0, "maxPriority": None,
                                                "quotas": {}}


def test_nothing_stored_starts_from_the_defaults() -> None:
    merged = merged_settings(None, TenantSettingsBody.model_validate({"weight": 2}))
    assert merged == {"cohort": "default", "weight": 2.0, "maxPriority": None, "quotas": {}}
    TenantConfig.model_validate(merged)


def test_expiry_from_ttl_or_an_instant() -> None:
    assert expiry_of(TokenCreateBody(name="x", ttl_seconds=60), NOW) == NOW + timedelta(seconds=60)
    at = NOW + timedelta(days=1)
    assert expiry_of(TokenCreateBody(name="x", expires_at=at), NOW) == at
    assert expiry_of(TokenCreateBody(name="x"), NOW) is None
