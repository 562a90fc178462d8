"""``python -m trainyard_trainer`` / ``trainyard-train``: one torch rank of a trainyard job.

Started by a node agent with the rank environment contract; trains to ``maxSteps``,
checkpointing as the spec says, and reports StepMetrics / ShardWritten through its spool.

SIGUSR1 asks the rank to checkpoint and stop (see :mod:`trainyard_trainer.preemption`): its
handler only sets a flag, read at the next step boundary; the ranks then save that step
together and exit 7 (preempted).

SIGTERM keeps its default action (immediate death) on purpose: a rank spends its waits
inside C++ collectives, where a Python handler would not run until the collective times
out, so a handler would make revoked ranks linger. Nothing is lost: spool lines are
fsynced as written and a checkpoint becomes visible only by an atomic rename.
"""

from __future__ import annotations

import argparse
import logging
import sys

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from pydantic import ValidationError

from trainyard_common import exitcodes
from trainyard_common.spec import TrainingSpec
from trainyard_common.errors import ConfigError, TrainyardError
from trainyard_common.events import GangAllocated
from trainyard_common.settings import load_settings
from trainyard_common.spool import SpoolWriter
from trainyard_common.storage import ArtifactLayout
from trainyard_common.tracing import job_context, setup_tracing, shutdown_tracing

from trainyard_trainer.exits import RankEnd, exit_code_for
from trainyard_trainer.preemption import CHECKPOINT_REQUEST_FILE, CheckpointRequest, StoppedOnRequest
from trainyard_trainer.runtime import configure_determinism, init_distributed, select_runtime, shutdown_distributed
from trainyard_trainer.settings import RankSettings, describe_environment
from trainyard_trainer.training import resolve_job, train

log = logging.getLogger("trainyard_trainer")


def read_allocation(settings: RankSettings) -> GangAllocated:
    """The GangAllocated event the node agent wrote for this attempt (spec, start checkpoint)."""
    try:
        return GangAllocated.model_validate_json(settings.allocation_file.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"TRAINYARD_ALLOCATION_FILE {settings.allocation_file} does not exist") from None
    except ValidationError as exc:
        raise ConfigError(f"TRAINYARD_ALLOCATION_FILE {settings.allocation_file} is not a GangAllocated: {exc}") from exc


def apply_spec_choices(settings: RankSettings, spec: TrainingSpec) -> RankSettings:
    """The spec's sharding, activation checkpointing, precision and checkpoint mode, where it sets
    them, win over the rank's environment (which supplies the defaults)."""
    t, c = spec.training, spec.checkpoint_policy
    chosen = {
        "sharding": t.sharding,
        "activation_checkpointing": t.activation_checkpointing,
        "autocast": {"fp32": "off"}.get(t.precision, t.precision) if t.precision else None,
        "checkpoint_mode": c.mode,
    }
    return settings.model_copy(update={k: v for k, v in chosen.items() if v is not None})


def checkpoint_request(settings: RankSettings) -> CheckpointRequest:
    """This rank's checkpoint request (SIGUSR1 or the request file), its signal handler installed."""
    path = settings.checkpoint_request_file or (
        ArtifactLayout(settings.artifact_root).attempt_dir(settings.tenant, settings.job_id, settings.attempt)
        / CHECKPOINT_REQUEST_FILE)
    return CheckpointRequest(path, allocation_id=settings.allocation_id, epoch=settings.epoch).install()


def run_rank(settings: RankSettings) -> int:
    """The whole life of one rank; returns its exit code (and writes the exit note, when asked)."""
    end = RankEnd()
    code, error = exitcodes.ERROR, None
    try:
        code, error = _run_rank(settings, end)
    finally:
        if settings.exit_note_file is not None:
            try:
                end.write(settings.exit_note_file, code=code, error=error)
            except OSError as exc:
                log.warning("could not write the exit note %s: %r", settings.exit_note_file, exc)
    return code


def _run_rank(settings: RankSettings, end: RankEnd) -> tuple[int, str | None]:
    tracer = trace.get_tracer("trainyard_trainer")
    request = checkpoint_request(settings)
    with job_context(settings.traceparent), tracer.start_as_current_span(
        f"train rank {settings.rank}",
        attributes={"trainyard.job_id": settings.job_id, "trainyard.attempt": settings.attempt,
                    "trainyard.rank": settings.rank, "trainyard.world_size": settings.world_size},
    ) as span:
        try:
            allocation = read_allocation(settings)
            settings = apply_spec_choices(settings, allocation.spec)
            runtime = select_runtime(settings)
            configure_determinism(runtime, seed=allocation.spec.training.seed, rank=settings.rank,
                                  deterministic=allocation.spec.training.deterministic)
            job = resolve_job(settings, allocation, runtime)
            init_distributed(settings, runtime)
            with SpoolWriter(settings.events_file) as spool:
                progress = train(job, spool, request=request, end=end)
            log.info("done: step %d, %d tokens", progress.global_step, progress.consumed_tokens)
            return exitcodes.OK, None
        except StoppedOnRequest as exc:
            code = exit_code_for(exc)
            span.set_attribute("trainyard.exit_code", code)
            span.set_attribute("trainyard.stopped_at_step", exc.global_step)
            log.warning("%s (exit %d, %s)", exc, code, exitcodes.exit_reason(code))
            return code, None
        except Exception as exc:  # noqa: BLE001 - the process boundary: every error becomes an exit code
            code = exit_code_for(exc)
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            span.set_attribute("trainyard.exit_code", code)
            if isinstance(exc, TrainyardError):
                log.error("%s: %s (exit %d, %s)", type(exc).__name__, exc, code, exitcodes.exit_reason(code))
            else:
                log.exception("unexpected error (exit %d)", code)
            return code, f"{type(exc).__name__}: {exc}"
        finally:  # the SIGUSR1 handler stays: a late request must not kill a rank that is ending anyway
            shutdown_distributed()


def _parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="trainyard-train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment (set by the node agent):\n" + describe_environment()
        + "\n  OTEL_*                          OpenTelemetry export (OTLP), read by the SDK"
        + "\n\nExit codes: 0 ok, 1 error, 2 config, 3 nan, 4 checkpoint, 5 data, 6 oom, 7 preempted "
        + "(checkpointed on request and stopped).",
    )


def prewarm() -> None:
    """Import what a rank otherwise imports lazily on its way to the first step (about 2 s of
    CPU time: ``torch.use_deterministic_algorithms`` pulls in inductor's config, the optimizer
    wrapping pulls in ``torch.distributed.optim``). A warm interpreter (the node agent's
    ``TRAINYARD_WARM_RANKS``) calls this before it waits for a launch; a cold rank pays it anyway."""
    import importlib

    for name in ("torch._inductor.config", "torch.distributed.optim", "torch.distributed.device_mesh",
                 "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
                 "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        try:
            importlib.import_module(name)
        except ImportError:  # an optional extra that is not installed: the rank imports it if it needs it
            log.debug("prewarm: %s not importable", name)


def main(argv: list[str] | None = None) -> int:
    _parser().parse_args(argv)
    try:
        settings = load_settings(RankSettings)
    except ConfigError as exc:
        print(f"trainyard-train: {exc}", file=sys.stderr)
        return exitcodes.CONFIG
    sys.stdout.reconfigure(line_buffering=True)  # the node agent tails this into the rank log
    logging.basicConfig(
        level=settings.log_level.upper(), stream=sys.stdout,
        format=f"%(asctime)s rank{settings.rank} %(levelname)s %(name)s: %(message)s",
    )
    setup_tracing("trainyard-trainer", instance_id=f"{settings.job_id}/a{settings.attempt}/r{settings.rank}")
    code = run_rank(settings)
    shutdown_tracing()  # flush the rank's spans before the process ends
    return code


if __name__ == "__main__":
    sys.exit(main())
