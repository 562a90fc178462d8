"""rich renderables for the CLI. Pure: models in, tables and text out (printing is the caller's).

Every table is a :class:`~trainyard_cli.tables.Fitted` one: it shows the columns that fit the width it is
printed at, most important first (tables.py), and every cell is text, never markup.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.text import Text

from trainyard_cli.tables import Col, Fitted, as_text

if TYPE_CHECKING:  # the API's models cost an import the --help of a command should not pay
    from rich.table import Table

    from trainyard_cli.client import Artifact, Dataset, Job, Trigger
    from trainyard_contract.wire import CheckpointView, JobSummary

STATE_STYLES = {
    "queued": "yellow",
    "running": "cyan",
    "paused": "magenta",
    "succeeded": "green",
    "failed": "bold red",
    "cancelled": "dim",
    "READY": "green",
    "PENDING": "yellow",
    "FAILED": "bold red",
    "DELETED": "dim",
}


def state_text(state: str) -> Text:
    return Text(state, style=STATE_STYLES.get(state, ""))


def fmt_tokens(n: int | None) -> str:
    """1234 → 1.2k, 3_400_000 → 3.4M."""
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def fmt_loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def fmt_rate(x: float | None) -> str:
    """Tokens per second, short: 1234.5 → 1.2k."""
    return "-" if x is None else fmt_tokens(round(x))


def fmt_time(t: datetime | None) -> str:
    """UTC, to the second: ``2024-05-01 12:00:03Z``."""
    if t is None:
        return "-"
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def fmt_step(step: int, max_steps: int | None) -> str:
    return f"{step}/{max_steps}" if max_steps else str(step)


JOB_COLUMNS = (
    Col("JOB", keep=100), Col("NAME", "middle", keep=60, min_width=12), Col("STATE", keep=95),
    Col("STEP", keep=80, justify="right"), Col("LOSS", keep=55, justify="right"),
    Col("MODEL", "middle", keep=30, min_width=10), Col("DATASET", "middle", keep=40, min_width=14),
    Col("GPUS", keep=20, justify="right"), Col("ATTEMPTS", keep=10, justify="right"), Col("CREATED", keep=50),
    Col("NOTE", "wrap", keep=90, min_width=24),
)
"""``jobs list``: at 80 columns JOB, NAME, STATE, STEP and the note (why it waits or failed) are shown."""


def jobs_table(items: Sequence[JobSummary]) -> Fitted:
    table = Fitted("training jobs", JOB_COLUMNS)
    for j in items:
        table.add_row(
            j.job_id, j.name or "-", state_text(j.state), fmt_step(j.global_step, j.max_steps),
            fmt_loss(j.last_loss), j.model or "-", j.dataset or "-", str(j.gpu_count or "-"),
            str(j.attempts), fmt_time(j.created_at), j.queued_reason or j.reason or "",
        )
    return table


CHECKPOINT_COLUMNS = (
    Col("CHECKPOINT", keep=100), Col("STATE", keep=95), Col("STEP", keep=90, justify="right"),
    Col("ATTEMPT", keep=20, justify="right"), Col("TOKENS", keep=30, justify="right"),
    Col("TENSORS HASH", "middle", keep=70, min_width=14),
    Col("CONTENT HASH", "middle", keep=60, min_width=14), Col("MANIFEST", "middle", keep=80, min_width=24),
    Col("READY AT", keep=40),
)


def checkpoints_table(items: Sequence[CheckpointView], title: str = "checkpoints", *,
                      manifests: bool = True) -> Fitted:
    """``manifests=False`` (inside a job's view) leaves the long manifest URIs to ``jobs checkpoints``."""
    table = Fitted(title, [c for c in CHECKPOINT_COLUMNS if manifests or c.header != "MANIFEST"])
    for c in items:
        row: list[str | Text] = [
            c.checkpoint_id, state_text(c.state), str(c.global_step), str(c.attempt), fmt_tokens(c.consumed_tokens),
            (c.tensors_hash or "-")[:19], (c.content_hash or "-")[:19], c.manifest_uri or "-", fmt_time(c.ready_at)]
        if not manifests:
            row.pop(7)
        table.add_row(*row)
    return table


ARTIFACT_COLUMNS = (
    Col("ARTIFACT", "middle", keep=100, min_width=30), Col("TYPE", keep=90), Col("STEP", keep=85, justify="right"),
    Col("ATTEMPT", keep=10, justify="right"), Col("HASH", "middle", keep=50, min_width=14),
    Col("TENSORS HASH", "middle", keep=45, min_width=14), Col("DATASET", "middle", keep=40, min_width=14),
    Col("SPEC HASH", "middle", keep=20, min_width=14),
    Col("CODE", "middle", keep=30, min_width=10), Col("URI", "middle", keep=80, min_width=24),
)


def artifacts_table(items: Sequence[Artifact]) -> Fitted:
    table = Fitted("artifacts", ARTIFACT_COLUMNS)
    for a in items:
        code = a.lineage.get("codeArchive")
        table.add_row(
            a.artifact_id, a.type, str(a.global_step), str(a.producer_attempt), a.hash[:19],
            (a.tensors_hash or "-")[:19], str(a.lineage.get("dataset", "-")),
            str(a.lineage.get("specHash", "-"))[:19],
            str(code)[:19] if code else "built-in", a.uri,
        )
    return table


DATASET_COLUMNS = (
    Col("DATASET", "middle", keep=100, min_width=20), Col("OWNER", "middle", keep=70, min_width=8),
    Col("SHARED WITH", "wrap", keep=40, min_width=11), Col("TOKENIZER", "middle", keep=30, min_width=10),
    Col("TOKENS", keep=75, justify="right"), Col("SHA256", "middle", keep=50, min_width=10),
    Col("MANIFEST", "middle", keep=60, min_width=24),
)


def datasets_table(items: Sequence[Dataset]) -> Fitted:
    table = Fitted("datasets", DATASET_COLUMNS)
    for d in items:
        ref = f"{d.tenant}/{d.name}@{d.version}" if d.tenant else f"{d.name}@{d.version}"
        table.add_row(ref, d.tenant or "platform", ", ".join(d.shared_with) or "-", d.tokenizer or "-",
                      fmt_tokens(d.num_tokens), d.sha256[:16], d.manifest_uri)
    return table


ATTEMPT_COLUMNS = (
    Col("ATTEMPT", keep=100, justify="right"), Col("STATE", keep=95), Col("NODES", "wrap", keep=40, min_width=10),
    Col("WORLD", keep=30, justify="right"), Col("STARTED", keep=60), Col("ENDED", keep=50),
    Col("FAILURE", "wrap", keep=90, min_width=24),
)


def facts_grid() -> Table:
    """Key/value lines (``jobs get``, ``triggers show``): the value wraps at words in what the key leaves."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    return grid


def job_detail(job: Job) -> RenderableType:
    """``jobs get``: a key/value summary, then attempts and checkpoints."""
    p = job.progress
    facts = facts_grid()
    spec = job.spec
    rows: list[tuple[str | Text, str | Text]] = [
        ("job", job.job_id),
        ("name", job.name or "-"),
        ("state", state_text(job.state)),
        ("tenant", job.tenant or "-"),
        ("model", str(spec.get("modelConfig", "-")) if isinstance(spec.get("modelConfig"), str) else "inline"),
        ("dataset", str(spec.get("dataset", "-"))),
        ("gpus", str(spec.get("resources", {}).get("gpuCount", "-"))),
        ("spec hash", job.spec_hash),
        ("step", fmt_step(p.global_step, p.max_steps)),
        ("tokens", fmt_tokens(p.consumed_tokens)),
        ("loss", fmt_loss(p.last_loss)),
        ("tokens/s", fmt_rate(p.tokens_per_second)),
        ("created", fmt_time(job.created_at)),
        ("updated", fmt_time(job.updated_at)),
    ]
    rows.extend(code_rows(spec.get("code")))
    if job.triggered_by:
        t = job.triggered_by
        rows.append(("triggered by", f"{t.get('triggerName')} ({t.get('triggerId')}), new version {t.get('dataset')}"))
    if job.queued_reason:
        kind = f" ({job.queued_reason_kind})" if job.queued_reason_kind else ""
        rows.append(("waiting", job.queued_reason + kind))
    for c in job.conditions:  # the operator should see these first
        rows.append((Text("condition", style="red"), f"{c.get('type')}: {c.get('reason')}"))
    if job.goodput:
        rows.append(("goodput", fmt_goodput(job.goodput)))
    if job.checkpoint_advice:
        rows.append(("ckpt advice", fmt_advice(job.checkpoint_advice)))
    for s in job.stragglers[:3]:
        rows.append(("straggler", f"attempt {s.get('attempt')} rank {s.get('rank')} on {s.get('nodeId')}: "
                                  f"{s.get('slowdown', 0):.2f}x the median compute time"))
    rows.extend(environment_rows(job))
    if job.reason:
        rows.append(("reason", job.reason))
    for key, value in rows:
        facts.add_row(key, as_text(value))
    parts: list[RenderableType] = [facts]
    if job.attempts:
        attempts = Fitted("attempts", ATTEMPT_COLUMNS)
        for a in job.attempts:
            attempts.add_row(str(a.attempt), state_text(a.state), ",".join(a.nodes) or "-", str(a.world_size or "-"),
                             fmt_time(a.started_at), fmt_time(a.ended_at), a.failure_reason or "")
        parts.append(attempts)
    if job.checkpoints:
        parts.append(checkpoints_table(job.checkpoints, "checkpoints (manifests: trainyard jobs checkpoints <job>)",
                                       manifests=False))
    return Group(*parts)


def code_rows(code: Any) -> list[tuple[str, str]]:
    """The job's own code, as ``jobs get`` shows it (nothing for the built-in trainer)."""
    if not isinstance(code, Mapping):
        return []
    rows = [("code", str(code.get("archive") or "-"))]
    if code.get("repo"):
        rows.append(("code repo", f"{code['repo']} @ {code.get('revision')}"))
    if code.get("commit"):
        rows.append(("code commit", str(code["commit"]) + (" (dirty)" if code.get("dirty") else "")))
    elif code.get("dirty") is not None:
        rows.append(("code commit", "- (dirty)" if code["dirty"] else "-"))
    entrypoint = code.get("entrypoint") or []
    rows.append(("entrypoint", shlex.join(str(a) for a in entrypoint) if entrypoint else "-"))
    if code.get("workingDir"):
        rows.append(("working dir", str(code["workingDir"])))
    if code.get("image"):
        rows.append(("image", str(code["image"])))
    env = code.get("environment")
    if isinstance(env, Mapping):
        rows.append(("environment", f"{env.get('lock')} {env.get('sha256') or ''}".strip()))
    return rows


def environment_rows(job: Job) -> list[tuple[str, str]]:
    """Each node's preparation of the latest attempt's environment: ``preparing environment`` while it builds."""
    if not job.attempts:
        return []
    rows = []
    latest = job.attempts[-1]
    if latest.starts:
        how = ", ".join(f"{n} {mode}" for mode, n in sorted(latest.starts.items()))
        rows.append(("ranks started", how + (f" ({latest.start_detail})" if latest.start_detail else "")))
    for node, e in sorted(latest.environment.items()):
        if e.state == "building":
            what = f"preparing environment: building {e.packages} package(s), {e.elapsed_seconds:.0f}s"
        elif e.state == "ready":
            what = "environment ready" + (" (cached)" if e.cached else f" (built in {e.elapsed_seconds:.1f}s)")
        else:
            what = "environment failed"
        rows.append((f"env on {node}", what + (f" — {e.detail}" if e.detail else "")))
    return rows


def fmt_goodput(g: Mapping[str, Any]) -> str:
    """``62% of 1.2e+03 device-s productive; wasted: lostWork 40, launchRestore 12 …``"""
    share = g.get("goodput")
    head = f"{share:.0%}" if isinstance(share, (int, float)) else "-"
    wasted = ", ".join(f"{k} {v:.0f}" for k, v in (g.get("wasted") or {}).items() if v)
    return (f"{head} of {g.get('allocatedDeviceSeconds', 0):.0f} device-s productive"
            f"{'; wasted: ' + wasted if wasted else ''}")


def fmt_advice(a: Mapping[str, Any]) -> str:
    """``every 37 steps (daly; now 20)``"""
    steps = a.get("intervalSteps")
    head = f"every {steps} steps" if steps else "no advice yet"
    method = a.get("method") or "-"
    current = a.get("currentIntervalSteps")
    return f"{head} ({method}{f'; now {current}' if current else ''}){' auto' if a.get('auto') else ''}"


NODE_COLUMNS = (
    Col("NODE", "middle", keep=100, min_width=16), Col("HOST", "middle", keep=50, min_width=10),
    Col("RACK", "middle", keep=30, min_width=6), Col("DEVICES", keep=40, justify="right"), Col("HEALTHY", keep=90),
    Col("QUARANTINE", "wrap", keep=80, min_width=24), Col("DRAIN", "wrap", keep=70, min_width=16),
    Col("SCORE", keep=20, justify="right"),
)


def nodes_table(nodes: Sequence[Mapping[str, Any]]) -> Fitted:
    """``admin nodes list``."""
    table = Fitted(None, NODE_COLUMNS)
    for n in nodes:
        q = n.get("quarantine") or {}
        quarantine = f"{q.get('reason') or 'yes'} (by {q.get('by') or '-'})" if n.get("quarantined") else "-"
        d = n.get("drain") or {}
        drain = f"{d.get('reason') or 'yes'} (by {d.get('by') or '-'})" if n.get("drained") else "-"
        score = n.get("reputationScore")
        table.add_row(n["nodeId"], n.get("host", "-"), n.get("rack") or "-", str(len(n.get("devices", []))),
                      "yes" if n.get("healthy") else "no", quarantine, drain,
                      f"{score:.2f}" if score is not None else "-")
    return table


def field_problems(problems: Sequence[tuple[str, str]], what: str = "spec") -> Text:
    """A 422's problems, one per line: ``  training.globalBatchSize: must be a multiple …``."""
    text = Text(f"the API rejected the {what}:\n", style="bold red")
    for field, message in problems:
        text.append(f"  {field or f'({what})'}", style="bold")
        text.append(f": {message}\n")
    return text


TRIGGER_COLUMNS = (
    Col("TRIGGER", keep=100), Col("NAME", "middle", keep=70, min_width=10),
    Col("DATASET", "middle", keep=80, min_width=12), Col("SOURCES", "wrap", keep=30, min_width=8),
    Col("MODEL", "middle", keep=20, min_width=10), Col("ENABLED", keep=60),
    Col("LAST FAILURE", "wrap", keep=90, min_width=24),
)


def triggers_table(items: Sequence[Trigger]) -> Fitted:
    """``triggers list``: one row per trigger, with its last failure when it has one."""
    table = Fitted("triggers", TRIGGER_COLUMNS)
    for t in items:
        model = t.template.get("modelConfig")
        failure = f"{t.last_failure.dataset}: {t.last_failure.message}" if t.last_failure else "-"
        watched = t.dataset if t.on != "checkpointReady" else f"checkpoints of {t.job or t.experiment}"
        table.add_row(t.trigger_id, t.name, watched, ",".join(t.sources),
                      model if isinstance(model, str) else "inline", "yes" if t.enabled else "no", failure)
    return table


def evaluations_table(items: Sequence[dict[str, Any]], *, title: str) -> Fitted:
    """``jobs evaluations``: one row per evaluation of one of the job's checkpoints, by step."""
    table = Fitted(title, (Col("STEP", keep=100), Col("METRICS", "wrap", keep=90, min_width=20),
                           Col("EVALUATION JOB", keep=80), Col("CHECKPOINT", "middle", keep=60, min_width=16),
                           Col("FINISHED", keep=50)))
    for e in items:
        metrics = "  ".join(f"{k} {v:.6g}" for k, v in sorted(e.get("metrics", {}).items()))
        table.add_row(str(e.get("globalStep")), metrics, e.get("evaluationJobId", "-"), e.get("checkpointId", "-"),
                      str(e.get("finishedAt", "-"))[:19].replace("T", " "))
    return table


def trigger_detail(t: Trigger) -> RenderableType:
    """``triggers show``: what it matches, what it submits, the jobs it started and its last failure."""
    facts = facts_grid()
    model = t.template.get("modelConfig")
    resources = t.template.get("resources") or {}
    for key, value in (
        ("trigger", t.trigger_id), ("name", t.name), ("tenant", t.tenant or "-"),
        ("dataset", f"{t.dataset}  (names matched; sources: {', '.join(t.sources)})") if t.on != "checkpointReady"
        else ("watches", f"READY checkpoints of {'job ' + t.job if t.job else 'experiment ' + str(t.experiment)}"
                         + (f", every {t.every_steps} steps" if t.every_steps else "")),
        ("enabled", "yes" if t.enabled else "no"),
        ("model", model if isinstance(model, str) else "inline"),
        ("resources", f"{resources.get('gpuCount', '?')} x {resources.get('gpuType', '?')}"),
        ("created", f"{fmt_time(t.created_at)} by {t.created_by or '-'}"),
    ):
        facts.add_row(key, as_text(value))
    parts: list[RenderableType] = [facts]
    if t.last_failure is not None:
        f = t.last_failure
        text = Text(f"last failure ({fmt_time(f.at)}, {f.dataset}): {f.message}\n", style="red")
        for p in f.problems:
            text.append(f"  {p.get('field', '')}: {p.get('message', '')}\n")
        parts.append(text)
    jobs = Fitted("jobs started", (Col("DATASET", "middle", keep=80, min_width=20), Col("JOB", keep=100)))
    for j in t.jobs or []:
        jobs.add_row(j.dataset, j.job_id)
    parts.append(jobs if t.jobs else Text("no jobs started yet", style="dim"))
    return Group(*parts)
