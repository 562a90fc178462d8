"""The local stack's Prometheus scrapes with the stack's metrics token (the metrics name tenants and jobs)."""

from __future__ import annotations

import stat
from pathlib import Path

from trainyard_cli import observe


def test_the_metrics_token_is_made_once_and_private(tmp_path: Path) -> None:
    first = observe.metrics_token(tmp_path)
    path = observe.metrics_token_file(tmp_path)
    assert len(first) >= 32 and path.read_text().strip() == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert observe.metrics_token(tmp_path) == first  # a restarted stack keeps it: running components use it


def test_prometheus_sends_it_on_every_scrape(tmp_path: Path) -> None:
    (job,) = observe.config(tmp_path, scrape_interval_s=1.0)["scrape_configs"]
    assert job["authorization"] == {"type": "Bearer",
                                    "credentials_file": str(observe.metrics_token_file(tmp_path))}
