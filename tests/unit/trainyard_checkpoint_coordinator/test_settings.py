"""The coordinator's settings: the shard-report retry cap under its own name, the old shared name still read."""

from __future__ import annotations

import warnings

import pytest

from trainyard_contract.settings import settings_help

from trainyard_checkpoint_coordinator.settings import CoordinatorSettings

OLD, NEW = "TRAINYARD_RETRY_BACKOFF_MAX_S", "TRAINYARD_SHARD_REPORT_RETRY_MAX_S"


@pytest.fixture(autouse=True)
def _no_retry_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OLD, raising=False)
    monkeypatch.delenv(NEW, raising=False)


def test_the_shard_report_retry_doubles_from_0_4_s_to_its_cap() -> None:
    policy = CoordinatorSettings().shard_report_retry()
    assert [policy.delay(n) for n in (1, 2, 3)] == [0.4, 0.8, 1.0]
    assert CoordinatorSettings(shard_report_retry_max_s=0.25).shard_report_retry().delay(1) == 0.25


def test_the_old_name_is_still_read_with_a_warning_naming_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OLD, "2")
    with pytest.warns(FutureWarning, match=f"{OLD} is deprecated: CoordinatorSettings reads it as {NEW}"):
        settings = CoordinatorSettings()
    assert settings.shard_report_retry_max_s == 2.0


def test_the_new_name_wins_without_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old variable is also the scheduler's (its job back-off cap): set beside the new one, it is theirs."""
    monkeypatch.setenv(OLD, "60")
    monkeypatch.setenv(NEW, "3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CoordinatorSettings().shard_report_retry_max_s == 3.0
        assert CoordinatorSettings(shard_report_retry_max_s=4).shard_report_retry_max_s == 4.0


def test_help_lists_the_deprecated_name() -> None:
    text = settings_help(CoordinatorSettings)
    assert NEW in text and f"{OLD}  (deprecated: {NEW})" in text
