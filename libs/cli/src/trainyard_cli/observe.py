"""Prometheus for the local stack (``TRAINYARD_PROMETHEUS=1``, ``make observe``).

Each service and node agent the stack starts gets a metrics port (``TRAINYARD_METRICS_PORT``) and a target
file, ``<state>/prometheus/targets/<component>.json`` (file-based service discovery: a component started
again on another port replaces its own file, Prometheus follows). ``prometheus`` (Debian's package; ``make
deps`` installs it) runs on 127.0.0.1 with its storage under ``<state>/prometheus/data`` and the rules of
``deploy/prometheus/rules/`` — the same rules the compose stack loads and ``promtool`` checks in the tests.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import yaml

from trainyard_cli import infra
from trainyard_contract.errors import ConfigError

RULES_DIR = Path(__file__).resolve().parents[4] / "deploy" / "prometheus" / "rules"
"""The repository's rule files (absent when the CLI is installed without the repository: no rules then)."""
JOB = "trainyard"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        raise ConfigError("prometheus is not installed. `make deps` installs it (Debian's `prometheus`, as root); "
                          "or run without TRAINYARD_PROMETHEUS")
    return found


def targets_dir(root: Path) -> Path:
    return root / "prometheus" / "targets"


def write_target(root: Path, component: str, service: str, port: int) -> Path:
    """The component's file_sd target (written whole, then renamed: Prometheus never reads half a file)."""
    path = targets_dir(root) / f"{component}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = [{"targets": [f"127.0.0.1:{port}"], "labels": {"service": service, "component": component}}]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def metrics_token_file(root: Path) -> Path:
    return root / "prometheus" / "metrics-token"


def metrics_token(root: Path) -> str:
    """The stack's metrics token (``TRAINYARD_METRICS_TOKEN`` of every component; Prometheus sends it), made
    once, mode 0600: the metrics name tenants and jobs."""
    path = metrics_token_file(root)
    try:
        found = path.read_text().strip()
    except FileNotFoundError:
        found = ""
    if found:
        return found
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def forget(root: Path, stopped: list[str]) -> None:
    """After ``down``: the stopped components' targets, and Prometheus' URL if it was one of them."""
    for name in stopped:
        (targets_dir(root) / f"{name}.json").unlink(missing_ok=True)
    if "prometheus" in stopped:
        (root / "prometheus-url").unlink(missing_ok=True)


def config(root: Path, *, scrape_interval_s: float, rules_dir: Path = RULES_DIR) -> dict:
    """prometheus.yml of the local stack: one job over every target file, the repository's rules."""
    interval = f"{max(int(scrape_interval_s * 1000), 100)}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules_dir / "*.yml")] if rules_dir.is_dir() else [],
        "scrape_configs": [{
            "job_name": JOB,
            "authorization": {"type": "Bearer", "credentials_file": str(metrics_token_file(root))},
            "file_sd_configs": [{"files": [str(targets_dir(root) / "*.json")], "refresh_interval": "5s"}],
        }],
    }


def start_prometheus(root: Path, port: int, log_path: Path, *, scrape_interval_s: float) -> infra.Launched:
    """prometheus on 127.0.0.1:``port`` over the stack's targets, storage under ``root/prometheus/data``."""
    infra.require_free_port(port, "prometheus", "TRAINYARD_PROMETHEUS_PORT")
    home = root / "prometheus"
    (home / "data").mkdir(parents=True, exist_ok=True)
    targets_dir(root).mkdir(parents=True, exist_ok=True)
    metrics_token(root)  # before Prometheus reads its credentials file
    config_file = home / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config(root, scrape_interval_s=scrape_interval_s), sort_keys=False))
    cmd = [
        prometheus_binary(), f"--config.file={config_file}", f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=7d",
    ]
    proc = infra._spawn(cmd, log_path)  # noqa: SLF001 - the launchers' shared spawn
    infra.wait_for_port(port, process=proc, what="prometheus", log_path=log_path)
    return infra.Launched("prometheus", proc, f"http://127.0.0.1:{port}", log_path)
