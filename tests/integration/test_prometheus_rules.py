"""The Prometheus rules (deploy/prometheus/rules) are valid and do what they say: ``promtool check rules``, then
``promtool test rules`` runs deploy/prometheus/tests (each alert fires on the series that should raise it, stays
quiet on the others; recording rules give the expected values). Both Prometheus configs (compose, and the one the
local stack writes) pass ``promtool check config``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from trainyard_cli import observe

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: `make deps` installs Debian's prometheus")


def promtool(*args: str, cwd: Path = PROMETHEUS) -> str:
    done = subprocess.run([PROMTOOL or "promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_rules_are_valid() -> None:
    rule_files = sorted(str(p) for p in (PROMETHEUS / "rules").glob("*.yml"))
    assert rule_files
    out = promtool("check", "rules", *rule_files)
    assert "SUCCESS" in out


def test_rule_unit_tests_pass() -> None:
    tests = sorted(str(p.relative_to(PROMETHEUS)) for p in (PROMETHEUS / "tests").glob("*.yml"))
    assert tests
    out = promtool("test", "rules", *tests)
    assert "SUCCESS" in out and "FAILED" not in out


def test_every_alert_has_a_unit_test() -> None:
    alerts = {r["alert"] for p in (PROMETHEUS / "rules").glob("*.yml")
              for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tested = {t["alertname"] for p in (PROMETHEUS / "tests").glob("*.yml")
              for case in yaml.safe_load(p.read_text())["tests"] for t in case.get("alert_rule_test", [])}
    assert alerts >= {"TrainyardJobQueuedTooLong", "TrainyardGoodputLow", "TrainyardStragglers",
                      "TrainyardCheckpointFailures", "TrainyardNodeLost"}
    assert alerts <= tested, f"untested alerts: {sorted(alerts - tested)}"


def test_configs_are_valid(tmp_path: Path) -> None:
    promtool("check", "config", str(REPO / "deploy" / "compose" / "prometheus.yml"))
    local = tmp_path / "prometheus.yml"
    observe.metrics_token(tmp_path)  # the credentials file the scrape config names (made before Prometheus starts)
    local.write_text(yaml.safe_dump(observe.config(tmp_path, scrape_interval_s=1.0)))
    observe.write_target(tmp_path, "node-agent-0", "node-agent", 9401)
    out = promtool("check", "config", str(local))
    assert "rule files found" in out or "SUCCESS" in out


def test_the_kubernetes_config_is_valid_with_the_rules(tmp_path: Path) -> None:
    """deploy/k8s/prometheus.yaml's prometheus.yml, with its rule_files pointed at deploy/prometheus/rules (in the
    cluster a ConfigMap made from them, mounted at /etc/prometheus/rules): the config, its relabelling and every
    rule load. Debian builds Prometheus without Kubernetes discovery, so its promtool cannot parse
    ``kubernetes_sd_configs``: that block is checked for its shape here and stood in for by a static target."""
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "prometheus.yaml").read_text()))
    config = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["prometheus.yml"])
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    (scrape,) = config["scrape_configs"]
    assert scrape["job_name"] == "trainyard"  # what the rules' up{job=…} and the dashboards expect
    assert scrape.pop("kubernetes_sd_configs") == [{"role": "pod", "namespaces": {"names": ["trainyard"]}}]
    scrape["static_configs"] = [{"targets": ["localhost:9400"]}]
    config["rule_files"] = [str(PROMETHEUS / "rules" / "*.yml")]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = promtool("check", "config", str(path))
    assert "SUCCESS" in out and "rules found" in out
