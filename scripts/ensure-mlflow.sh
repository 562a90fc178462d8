#!/usr/bin/env bash
# Installs a real MLflow tracking server into its own virtual environment, .tools/mlflow, for the tracking
# exporter's tests (tests/integration/test_tracking.py). Not in .venv: mlflow's pins would fight the project's (it
# has pulled a CUDA torch), and no service imports it: the exporter speaks MLflow's REST API over httpx.
# Idempotent: does nothing when .tools/mlflow already runs `mlflow --version`.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=.tools/mlflow
SPEC="${TRAINYARD_MLFLOW_SPEC:-mlflow>=3.17,<4}"
if "$TOOLS/bin/mlflow" --version >/dev/null 2>&1; then
  exit 0
fi
PYTHON="${PYTHON:-python3}"
echo "installing $SPEC into $TOOLS (the tracking tests' MLflow server)…"
rm -rf "$TOOLS"
"$PYTHON" -m venv "$TOOLS"
# uv (the node agent's dependency, so in .venv after `make venv`) resolves and downloads in parallel: seconds
# where pip takes about a minute for mlflow's ~100 packages
if ! { [ -x .venv/bin/uv ] && .venv/bin/uv pip install --quiet --python "$TOOLS/bin/python" "$SPEC"; }; then
  "$TOOLS/bin/pip" install --quiet --disable-pip-version-check "$SPEC"
fi
"$TOOLS/bin/mlflow" --version
