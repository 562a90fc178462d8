"""``python -m trainyard_trainer`` / ``trainyard-train``: one torch rank of a trainyard job.

Started by a node agent with the rank environment contract; trains to ``maxSteps``,
checkpointing as the spec says, and reports StepMetrics / ShardWritten through its spool.

SIGUSR1 asks the rank to checkpoint and stop (see :mod:`trainyard.preemption`): its
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

from trainyard import Run
from trainyard.environment import apply_spec_choices, checkpoint_request, read_allocation
from trainyard.exits import RankEnd, exit_code_for
from trainyard.run import conclude
from trainyard.settings import RankSettings, describe_environment
from trainyard_contract import exitcodes
from trainyard_contract.errors import ConfigError
from trainyard_contract.settings import load_settings
from trainyard_contract.tracing import job_context, setup_tracing, shutdown_tracing

from trainyard_trainer.training import resolve_job, train

__all__ = ["apply_spec_choices", "checkpoint_request", "exit_code_for", "main", "prewarm", "read_allocation",
           "run_rank"]

log = logging.getLogger("trainyard_trainer")


def run_rank(settings: RankSettings) -> int:
    """The whole life of one rank; returns its exit code (and writes the exit note, when asked).

    The rank is a user of the SDK like any script: ``Run.open`` (the SIGUSR1 handler first, then
    allocation, runtime, determinism, process group, spool), the trainer's loop, ``Run.finish``
    (the exit code, the exit note). The SIGUSR1 handler stays installed to the end: a late
    request must not kill a rank that is ending anyway."""
    end = RankEnd()
    tracer = trace.get_tracer("trainyard_trainer")
    with job_context(settings.traceparent), tracer.start_as_current_span(
        f"train rank {settings.rank}",
        attributes={"trainyard.job_id": settings.job_id, "trainyard.attempt": settings.attempt,
                    "trainyard.rank": settings.rank, "trainyard.world_size": settings.world_size},
    ):
        try:
            run = Run.open(settings, end=end)
        except Exception as exc:  # noqa: BLE001 - the process boundary: every error becomes an exit code
            return conclude(settings, end, exc)
        failure: BaseException | None = None
        try:
            job = resolve_job(run.settings, run.allocation, run.runtime)
            progress = train(job, run)
            log.info("done: step %d, %d tokens", progress.global_step, progress.consumed_tokens)
        except Exception as exc:  # noqa: BLE001 - handed to finish, which maps it to an exit code
            failure = exc
        return run.finish(failure)


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
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a TextIOWrapper; the agent tails it
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
