"""`trainyard admin` option parsing (pure): durations, quotas, limits."""

from __future__ import annotations

import pytest

from trainyard_cli.admin import parse_duration, parse_quota, quota_limit
from trainyard_contract.errors import ConfigError


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43_200),
                                                ("30d", 2_592_000), ("2w", 1_209_600)])
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "1y", "ten", "5 minutes"])
def test_bad_durations_say_what_to_write(text: str) -> None:
    with pytest.raises(ConfigError, match="15m"):
        parse_duration(text)


def test_quotas() -> None:
    assert parse_quota("cpu=8:4") == ("cpu", {"guaranteed": 8, "borrowLimit": 4})
    assert parse_quota("*=0") == ("*", {"guaranteed": 0, "borrowLimit": None})
    assert parse_quota("h100-80gb=unlimited") == ("h100-80gb", {"guaranteed": None, "borrowLimit": None})
    assert quota_limit("none", "--guaranteed") is None
    for bad in ("cpu", "=4", "cpu=lots"):
        with pytest.raises(ConfigError, match="--quota"):
            parse_quota(bad)
