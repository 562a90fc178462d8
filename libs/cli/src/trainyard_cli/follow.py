"""Following a job until it ends: a rich progress bar fed by polling ``GET /v1/training-jobs/{id}``.

``follow_job(client, job_id)`` is what ``trainyard submit --follow``, ``trainyard jobs follow``
and ``trainyard dev demo`` call; it returns the process exit code (0 when the job succeeded).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from trainyard_cli.client import ApiClient, ApiNotFoundError, ApiUnreachableError, Job
from trainyard_cli.render import fmt_loss, fmt_rate, fmt_step, fmt_tokens

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_CANCELLED = 3
EXIT_TIMEOUT = 4
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    message: str


def outcome(job: Job) -> Outcome | None:
    """How following ends for ``job``; None while it is not finished."""
    p = job.progress
    if job.state == "succeeded":
        ready = [c for c in job.checkpoints if c.state == "READY"]
        where = f"; checkpoint {ready[-1].manifest_uri}" if ready else ""
        return Outcome(EXIT_SUCCEEDED, f"{job.job_id} succeeded at step {p.global_step} "
                                       f"(loss {fmt_loss(p.last_loss)}, {fmt_tokens(p.consumed_tokens)} tokens){where}")
    if job.state == "failed":
        return Outcome(EXIT_FAILED, f"{job.job_id} failed: {job.reason or 'no reason recorded'}")
    if job.state == "cancelled":
        return Outcome(EXIT_CANCELLED, f"{job.job_id} was cancelled: {job.reason or 'no reason recorded'}")
    return None


def progress_fields(job: Job) -> dict[str, object]:
    """What the bar shows for ``job`` (total, completed and the text fields)."""
    p = job.progress
    return {
        "total": p.max_steps or None,
        "completed": p.global_step,
        "state": job.state,
        "step": fmt_step(p.global_step, p.max_steps),
        "attempt": str(job.attempt or "-"),
        "tokens": fmt_tokens(p.consumed_tokens),
        "loss": fmt_loss(p.last_loss),
        "tps": fmt_rate(p.tokens_per_second),
    }


def status_line(job: Job) -> str:
    """One line per state change (visible in logs, where the live bar is not)."""
    line = f"{job.job_id}: {job.state}"
    if job.attempt:
        line += f" (attempt {job.attempt})"
    if job.state == "queued" and job.queued_reason:
        line += f", waiting: {job.queued_reason}"
    if job.reason and job.terminal:
        line += f": {job.reason}"
    return line


def _progress_bar(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[state]:<9}[/] attempt {task.fields[attempt]}"),
        BarColumn(),
        TextColumn("step {task.fields[step]}"),
        TextColumn("tokens {task.fields[tokens]}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def follow_job(
    client: ApiClient,
    job_id: str,
    *,
    console: Console | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    unreachable_grace_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Show the job's progress until it ends; returns 0 (succeeded), 1 (failed), 3 (cancelled),
    4 (``timeout_s`` passed) or 130 (Ctrl-C; the job keeps running). A brief API outage is
    ridden out for ``unreachable_grace_s``."""
    console = console or Console(stderr=True)
    started = clock()
    last_seen = started
    last_line = ""
    with _progress_bar(console) as bar:
        task: TaskID = bar.add_task(job_id, total=None, state="…", step="-", attempt="-", tokens="-", loss="-", tps="-")
        try:
            while True:
                try:
                    job = client.get_job(job_id)
                    last_seen = clock()
                except ApiUnreachableError:
                    if clock() - last_seen > unreachable_grace_s:
                        raise
                    sleep(poll_s)
                    continue
                except ApiNotFoundError:
                    console.print(f"no job {job_id} (for this token's tenant)", style="red", markup=False)
                    return EXIT_FAILED
                fields = progress_fields(job)
                bar.update(task, **fields)  # type: ignore[arg-type]  # progress_fields gives update's keywords
                line = status_line(job)
                if line != last_line:
                    bar.console.print(line, highlight=False, markup=False)
                    last_line = line
                if (end := outcome(job)) is not None:
                    style = "green" if end.exit_code == EXIT_SUCCEEDED else "red"
                    bar.console.print(end.message, style=style, highlight=False, markup=False)
                    return end.exit_code
                if timeout_s is not None and clock() - started > timeout_s:
                    bar.console.print(f"stopped following {job_id} after {timeout_s:.0f}s; "
                                      f"it is still {job.state}", style="yellow", markup=False)
                    return EXIT_TIMEOUT
                sleep(poll_s)
        except KeyboardInterrupt:
            bar.console.print(f"stopped following; {job_id} keeps running "
                              f"(`trainyard jobs get {job_id}`, `trainyard jobs cancel {job_id}`)", style="yellow",
                              markup=False)
            return EXIT_INTERRUPTED
