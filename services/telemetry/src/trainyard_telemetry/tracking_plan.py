"""The tracking exporter's decisions, pure: which targets a job goes to, which steps to send next given the cursor,
what a metric is called there, what the MLflow run carries. No Redis, no HTTP, no clock (docs/tracking.md).

A **cursor** per (job, target) says how far the target has the job: ``step`` (the next step to send), ``attempt``
(the highest history fence value, attempt + 1, among the steps sent), the TensorBoard file count, the MLflow run,
the evaluations sent and the state the run was ended with. It is saved after each piece reached the target, so a
restart resends at most the piece in flight (at-least-once).

A resumed attempt rewrites steps the cursor has passed (it replays from its checkpoint); the history's fence then
holds a higher attempt at those steps, and :func:`next_span` starts again at the first such step (TensorBoard is
told to drop what it had from there, MLflow gets the new values beside the old ones).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from trainyard_contract.spec import Tracking
from trainyard_contract.tracking import TenantTracking
from trainyard_telemetry.metrics_history import CURVES, SERIES_NAME, TIMING

Target = Literal["mlflow", "tensorboard"]
TARGETS: tuple[Target, ...] = ("mlflow", "tensorboard")

REWIND_WINDOW = 16_384  # steps behind the cursor checked for a resumed attempt's rewrites (32 KB of fence)
MLFLOW_BATCH = 1000  # metrics per runs/log-batch (MLflow's limit)
MLFLOW_PARAMS_BATCH = 100  # params (and tags) per runs/log-batch
MLFLOW_PARAM_VALUE = 6000  # characters of a param value
MLFLOW_TAG_VALUE = 8000
_RUN_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
_PARAM_SECTIONS = ("modelConfig", "dataset", "codeRevision", "resources", "parallelism", "checkpointPolicy",
                   "training", "name", "priority", "initFrom", "faultTolerance", "evaluation", "export")
_KEY_CHARS = re.compile(r"^[A-Za-z0-9_.:/ -]{1,250}$")  # what MLflow takes in a key (and TensorBoard shows)


@dataclass(frozen=True)
class Cursor:
    """How far one target has one job."""

    step: int = 0
    attempt: int = 0
    files: int = 0
    run_id: str | None = None
    evals: tuple[str, ...] = ()
    ended: str | None = None  # the terminal state the run was ended with

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, raw: str | bytes | None) -> Cursor:
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(step=int(data.get("step", 0)), attempt=int(data.get("attempt", 0)),
                   files=int(data.get("files", 0)), run_id=data.get("run_id"),
                   evals=tuple(data.get("evals", ())), ended=data.get("ended"))


def targets_of(tenant: TenantTracking | None, tracking: Tracking | None) -> tuple[Target, ...]:
    """The targets a job goes to: the tenant's, less those the job's spec turned off."""
    if tenant is None:
        return ()
    want = tracking or Tracking()
    out: list[Target] = []
    if tenant.mlflow_uri and want.mlflow:
        out.append("mlflow")
    if tenant.tensorboard and want.tensorboard:
        out.append("tensorboard")
    return tuple(out)


@dataclass(frozen=True)
class Span:
    """Steps ``first..last`` (inclusive) to send next; ``restart``: they redo steps the target already has."""

    first: int
    last: int
    restart: bool
    attempt: int  # the cursor's attempt once the span is sent


def next_span(cursor: Cursor, fence: np.ndarray, base: int, max_steps: int, *, settled: bool = False) -> Span | None:
    """The next steps to send, given rank 0's history fence from step ``base`` to its end (uint16, attempt + 1;
    0: no step there). None: nothing new.

    While the job runs (not ``settled``), a span stops before a step an older attempt wrote after a newer one's
    (the stale tail a resumed attempt has not replayed yet): it waits there to send the new values once, instead
    of the old ones now and the new ones later. A settled job's history is final: all of it goes."""
    end = base + len(fence)  # one past the last stored step
    behind = fence[: max(0, min(cursor.step, end) - base)]
    rewritten = np.nonzero(behind > cursor.attempt)[0]
    restart = bool(len(rewritten))
    first = base + int(rewritten[0]) if restart else cursor.step
    last = min(end - 1, first + max_steps - 1)
    if last < first:
        return None
    sent = fence[first - base: last - base + 1]
    if not settled:
        newest = np.maximum.accumulate(np.maximum(sent, 0 if restart else cursor.attempt))
        stale = np.nonzero((sent > 0) & (sent < newest))[0]
        if len(stale):
            if stale[0] == 0:
                return None
            last = first + int(stale[0]) - 1
            sent = sent[: int(stale[0])]
    attempt = max(cursor.attempt, int(sent.max()) if len(sent) else 0)
    return Span(first, last, restart, attempt)


def fence_base(cursor: Cursor) -> int:
    """The first step of the fence window :func:`next_span` needs."""
    return max(0, cursor.step - REWIND_WINDOW)


def _segments(name: str) -> str:
    # MLflow refuses a key that is not its own normal path ("a//b", "/a", "../a"): such segments become "_"s
    return "/".join(s if s not in ("", ".", "..") else "_" * max(1, len(s)) for s in name.split("/"))


def metric_key(section: str, name: str) -> str | None:
    """What series ``name`` is called in the targets (``train/loss``, ``system/stepSeconds``, ``eval/perplexity``):
    None for a name the history would not have stored (a rank chose it: any string). Never a path: TensorBoard
    keeps it inside the file, MLflow gets a key it accepts, so one odd name cannot fail a whole batch."""
    if not SERIES_NAME.match(name):
        return None
    key = f"{section}/{_segments(name)}"
    return key if _KEY_CHARS.match(key) else None


def series_keys(custom: list[str]) -> dict[str, str]:
    """History series → exported key: the built-in curves and custom series under ``train/``, timing under
    ``system/``."""
    out: dict[str, str] = {}
    for name in (*CURVES, *custom):
        if name not in out and name not in TIMING and (key := metric_key("train", name)):
            out[name] = key
    for name in TIMING:
        out[name] = f"system/{name}"
    return out


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
        return
    text = value if isinstance(value, str) else json.dumps(value)
    out[prefix] = text[:MLFLOW_PARAM_VALUE]


def run_params(spec_wire: Mapping[str, Any], experiment: Any = None) -> dict[str, str]:
    """The MLflow run's params: the spec's training fields flattened (``training.learningRate``,
    ``training.globalBatchSize``, ``modelConfig``, ``dataset`` …; not ``code``, whose ``env`` may hold
    secrets), and an experiment trial's point as ``trial.<name>``."""
    out: dict[str, str] = {}
    for section in _PARAM_SECTIONS:
        if section in spec_wire:
            _flatten(section, spec_wire[section], out)
    params = getattr(experiment, "params", None) or {}
    for name, value in params.items():
        if key := metric_key("trial", str(name)):
            out[key.replace("/", ".", 1)] = str(value)[:MLFLOW_PARAM_VALUE]
    return {k: v for k, v in out.items() if _KEY_CHARS.match(k)}


def run_tags(job: Any) -> dict[str, str]:
    """The run's tags: the job's id, tenant, spec hash and state, and its experiment and trial if it has one."""
    tags = {"trainyard.jobId": job.job_id, "trainyard.tenant": job.tenant, "trainyard.specHash": job.spec_hash,
            "trainyard.state": job.state}
    experiment = getattr(job, "experiment", None)
    if experiment is not None:
        tags["trainyard.experimentId"] = str(getattr(experiment, "experiment_id", ""))
        tags["trainyard.trial"] = str(getattr(experiment, "trial", ""))
    return {k: v[:MLFLOW_TAG_VALUE] for k, v in tags.items()}


def experiment_name(job: Any) -> str:
    """``<tenant>/<name>``: the spec's ``tracking.experimentName``, else the trainyard experiment's name, else
    ``jobs``. The tenant in front keeps tenants sharing one MLflow server out of each other's experiments."""
    tracking = job.spec.tracking
    experiment = getattr(job, "experiment", None)
    name = (tracking.experiment_name if tracking and tracking.experiment_name else None) or (
        getattr(experiment, "experiment_name", None) or getattr(experiment, "experiment_id", None)) or "jobs"
    return f"{job.tenant}/{name}"[:500]


def run_name(job: Any) -> str:
    tracking = job.spec.tracking
    return (tracking.run_name if tracking and tracking.run_name else None) or job.spec.name or job.job_id


def run_status(state: str) -> str | None:
    """The MLflow status a terminal job state ends its run with (None: not terminal)."""
    return _RUN_STATUS.get(state)


@dataclass(frozen=True)
class EvalPoint:
    evaluation_job_id: str
    step: int
    values: dict[str, float] = field(default_factory=dict)


def eval_points(raw: Mapping[str, str]) -> list[EvalPoint]:
    """The evaluation results of ``ty:evals:<job>`` as points at their global step, each metric under its
    ``eval/`` key; unreadable entries and names the targets cannot take are left out. In step order."""
    out: list[EvalPoint] = []
    for eval_id, text in raw.items():
        try:
            data = json.loads(text)
            step = int(data.get("globalStep", data.get("global_step")))
            metrics = data.get("metrics") or {}
        except (ValueError, TypeError, AttributeError):
            continue
        values = {key: float(v) for name, v in metrics.items()
                  if isinstance(v, int | float) and (key := metric_key("eval", str(name)))}
        if values and step >= 0:
            out.append(EvalPoint(str(eval_id), step, values))
    return sorted(out, key=lambda p: (p.step, p.evaluation_job_id))


def advanced(cursor: Cursor, span: Span) -> Cursor:
    return replace(cursor, step=span.last + 1, attempt=span.attempt)
