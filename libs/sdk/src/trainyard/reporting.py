"""What a rank reports of its steps: the count of what the job consumed (``run.progress``, once per step), the
StepMetrics event (spooled: the platform's metrics, stragglers and goodput read it), the user's own metrics
file, and MFU once the model's FLOPs per token are known. :class:`~trainyard.run.Run` delegates here."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainyard_contract.errors import NonFiniteError
from trainyard_contract.events import (
    EVALUATION_MAX_METRICS,
    EVALUATION_METRIC_NAME,
    EvaluationReported,
    StepMetrics,
)
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.spool import SpoolWriter
from trainyard_contract.tracing import current_traceparent

from trainyard.context import Context
from trainyard.exits import RankEnd
from trainyard.metrics import PeakFlops, device_peak_flops, mfu
from trainyard.runtime import Runtime
from trainyard.settings import RankSettings
from trainyard.state import Progress
from trainyard.timing import Timing

log = logging.getLogger("trainyard")
PEAK_FLOPS_CACHE = ("calibration", "peak-flops.json")  # under the node's root (the artifact root when local)


class StepReporter:
    """Counts the steps a rank completes and reports them (StepMetrics, the metrics file, MFU)."""

    def __init__(self, settings: RankSettings, spec: TrainingSpec, *, spool: SpoolWriter, timing: Timing,
                 end: RankEnd, attempt_dir: Path, node_root: Path, closers: contextlib.ExitStack) -> None:
        self.settings, self.spec, self.spool, self.timing, self.end = settings, spec, spool, timing, end
        self.attempt_dir, self.node_root, self.closers = attempt_dir, node_root, closers
        self.progress = Progress()
        self.peak: PeakFlops | None = None
        self.flops_per_token: float | None = None
        self.counted = 0  # the last step whose tokens progress counted
        self.last_report = time.perf_counter()
        self.nan_at: int | None = None
        self._metrics_file: Any = None

    @property
    def tokens_per_step(self) -> int:
        t = self.spec.training
        return t.global_batch_size * t.sequence_length

    def advance(self, step: int, *, tokens: int | None = None, samples: int | None = None) -> Progress:
        """Count ``step`` as done (once: the first call for a step counts its tokens and samples)."""
        p = self.progress
        if step > self.counted:
            t = self.spec.training
            p.consumed_tokens += self.tokens_per_step if tokens is None else tokens
            p.consumed_samples += t.global_batch_size if samples is None else samples
            self.counted = step
        p.global_step = max(p.global_step, step)
        self.end.global_step = step
        return p

    def restored(self, step: int) -> None:
        """The state was restored at ``step``: count from there, time the next report from now."""
        self.counted = max(self.counted, self.progress.global_step)
        self.end.global_step = step
        self.last_report = time.perf_counter()

    def enable_mfu(self, runtime: Runtime, ctx: Context, flops_per_token: float) -> PeakFlops | None:
        """The device's peak, probed once per host (the first local rank; a collective), and the model's FLOPs."""
        s = self.settings
        cache = self.node_root.joinpath(*PEAK_FLOPS_CACHE)
        first_on_host = s.local_rank == 0
        if first_on_host:
            self.peak = device_peak_flops(runtime.device, runtime.autocast_dtype, cache_file=cache,
                                          override=s.peak_flops)
        ctx.barrier()  # the others read the first rank's probe from the cache
        if not first_on_host:
            self.peak = device_peak_flops(runtime.device, runtime.autocast_dtype, cache_file=cache,
                                          override=s.peak_flops)
        self.flops_per_token = flops_per_token
        return self.peak

    def report(self, step: int, *, loss: float, tokens: int | None, samples: int | None, lr: float | None,
               metrics: Mapping[str, float]) -> StepMetrics:
        """StepMetrics for ``step`` (see :meth:`trainyard.run.Run.report`)."""
        if not math.isfinite(loss):
            self.end.global_step = self.nan_at = step
            raise NonFiniteError(f"loss {loss} at step {step} is not finite")
        now = time.perf_counter()
        seconds, self.last_report = now - self.last_report, now
        t = self.spec.training
        tokens = self.tokens_per_step if tokens is None else tokens
        samples = t.global_batch_size if samples is None else samples
        p = self.advance(step, tokens=tokens, samples=samples)
        times = self.timing.take()
        tokens_per_second = tokens / seconds if seconds > 0 else None
        step_mfu = None
        if tokens_per_second and self.peak and self.flops_per_token:
            step_mfu = mfu(flops_per_token=self.flops_per_token, tokens_per_second=tokens_per_second,
                           devices=self.settings.world_size, peak_flops=self.peak.flops)
        s = self.settings
        event = StepMetrics(
            job_id=s.job_id, tenant=s.tenant, attempt=s.attempt, rank=s.rank, step=step, max_steps=t.max_steps,
            loss=loss, lr=lr, consumed_tokens=p.consumed_tokens, consumed_samples=p.consumed_samples,
            tokens_per_second=tokens_per_second, mfu=step_mfu, step_seconds=seconds,
            compute_seconds=times.compute, collective_seconds=times.collective,
            data_wait_seconds=times.data_wait, checkpoint_seconds=times.checkpoint,
            metrics=finite_numbers(metrics),
        )
        # A step's metrics need not survive a host crash (the next step's replace them): no fsync.
        self.spool.write(event, traceparent=current_traceparent(), durable=False)
        if metrics:
            self._write_metrics(step, metrics)
        if log.isEnabledFor(logging.INFO):
            extra = "".join(f" {k} {v:.4g}" for k, v in metrics.items())
            log.info("step %d/%d loss %.4f lr %s%s %.0f tok/s mfu %s (data %.3fs compute %.3fs comm %.3fs "
                     "ckpt %.3fs)", step, t.max_steps, loss, f"{lr:.3g}" if lr is not None else "-", extra,
                     tokens_per_second or 0.0, f"{step_mfu:.4f}" if step_mfu is not None else "-",
                     times.data_wait, times.compute, times.collective, times.checkpoint)
        return event

    def report_evaluation(self, metrics: Mapping[str, float]) -> EvaluationReported | None:
        """EvaluationReported from rank 0 (durable: it is the evaluation's result); None on the other ranks."""
        numbers = evaluation_numbers(metrics)
        s = self.settings
        if s.rank != 0:
            return None
        event = EvaluationReported(job_id=s.job_id, tenant=s.tenant, attempt=s.attempt, rank=s.rank, metrics=numbers)
        self.spool.write(event, traceparent=current_traceparent(), durable=True)
        log.info("evaluation: %s", " ".join(f"{k} {v:.6g}" for k, v in numbers.items()))
        return event

    def _write_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._metrics_file is None:
            path = self.attempt_dir / "metrics" / f"rank{self.settings.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._metrics_file = self.closers.enter_context(path.open("a", buffering=1))
        self._metrics_file.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")


def finite_numbers(metrics: Mapping[str, float]) -> dict[str, float]:
    """The user's metrics as the event carries them: finite floats (a NaN accuracy is left out, not an error)."""
    out: dict[str, float] = {}
    for name, value in list(metrics.items())[:64]:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"run.report({name}=…): a metric must be a number, not {type(value).__name__}") from None
        if math.isfinite(number):
            out[str(name)[:128]] = number
    return out


class EvaluationReports:
    """What a :class:`~trainyard.run.Run` reports of an evaluation job (``spec.evaluation``), beside its steps."""

    reporter: StepReporter

    def report_evaluation(self, metrics: Mapping[str, float]) -> EvaluationReported | None:
        """Report what an evaluation job measured of the checkpoint it loaded (``initFrom``, restored by
        ``run.restore``): ``{"accuracy": 0.71, "loss": 2.3}``. Rank 0's call is spooled as EvaluationReported and
        the registry attaches it to that checkpoint (``trainyard jobs evaluations JOB`` of the trained job); the
        other ranks' calls only check the numbers. 1 to 32 metrics, names of a letter then letters, digits,
        ``_ . - /`` (64 at most), finite values: anything else is a ValueError here (and refused by the
        platform). The first report of an evaluation job is the one kept."""
        return self.reporter.report_evaluation(metrics)


def evaluation_numbers(metrics: Mapping[str, float]) -> dict[str, float]:
    """An evaluation's metrics as the event carries them, or ValueError saying what the platform would refuse:
    1 to 32 names of a letter then letters, digits, ``_ . - /`` (64 at most), each a finite number."""
    if not 1 <= len(metrics) <= EVALUATION_MAX_METRICS:
        raise ValueError(f"run.report_evaluation takes 1 to {EVALUATION_MAX_METRICS} metrics, not {len(metrics)}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not re.match(EVALUATION_METRIC_NAME, name):
            raise ValueError(f"run.report_evaluation: metric name {name!r} must match {EVALUATION_METRIC_NAME}")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"run.report_evaluation: {name} is {number}, not a finite number")
        out[name] = number
    return out
