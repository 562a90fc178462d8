"""The rank SDK installs and runs with the contract alone (issue 31): no broker, Redis, Prometheus or OTLP
package enters a training environment.

Two checks, both real: pip resolves what ``pip install libs/contract libs/sdk`` would install into a clean
environment (``--dry-run --ignore-installed --report``, the same resolver and indexes a user's pip has), and a
fresh interpreter that cannot import any runtime package imports every module of the SDK and of the contract
and sets up tracing (a no-op without the OpenTelemetry SDK).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Distribution names (normalised) and import names of the services' runtime.
RUNTIME_DISTRIBUTIONS = {"faststream", "aiokafka", "kafka-python", "redis", "prometheus-client",
                         "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http",
                         "opentelemetry-exporter-otlp-proto-common", "trainyard-runtime", "uvicorn", "fastapi"}
RUNTIME_MODULES = ("faststream", "aiokafka", "redis", "prometheus_client", "opentelemetry.sdk",
                   "opentelemetry.exporter", "trainyard_runtime", "uvicorn", "fastapi")


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_pip_resolves_the_sdk_without_runtime_packages(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
         "--report", str(report), str(REPO / "libs" / "contract"), str(REPO / "libs" / "sdk")],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    installed = {_normalise(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]}
    assert {"trainyard-sdk", "trainyard-contract", "pydantic", "torch"} <= installed
    assert not installed & RUNTIME_DISTRIBUTIONS, sorted(installed & RUNTIME_DISTRIBUTIONS)


_BLOCKED_RUN = """
import importlib, importlib.abc, pkgutil, sys
BLOCKED = {blocked!r}

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{{name}} is a runtime package: a rank must not need it")
        return None

sys.meta_path.insert(0, Block())
import trainyard, trainyard_contract
names = []
for package in (trainyard, trainyard_contract):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
from trainyard_contract.tracing import setup_tracing, shutdown_tracing, tracer
setup_tracing("rank-test")
with tracer("t").start_as_current_span("step"):
    pass
shutdown_tracing()
from trainyard.shardcache import ShardCacheMetrics
metrics = ShardCacheMetrics.of()  # unrecorded without prometheus-client, never an ImportError
metrics.requests.labels(rank="0", result="hit").inc()
metrics.fetch_seconds.labels(rank="0").observe(0.1)
print(len(names))
"""


def test_every_sdk_and_contract_module_imports_without_the_runtime() -> None:
    done = subprocess.run([sys.executable, "-c", _BLOCKED_RUN.format(blocked=RUNTIME_MODULES)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 30  # the SDK's and the contract's modules were all walked


@pytest.mark.parametrize("module", ["trainyard_runtime.bus", "trainyard_runtime.store"])
def test_the_block_above_would_catch_a_runtime_import(module: str) -> None:
    """The check cannot pass vacuously: importing a runtime module under the same block fails."""
    probe = _BLOCKED_RUN.split("import trainyard, trainyard_contract")[0] + f"import {module}\n"
    done = subprocess.run([sys.executable, "-c", probe.format(blocked=RUNTIME_MODULES)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode != 0
    assert "runtime package" in done.stderr
