"""``trainyard experiments …``: sweeps over a base spec (POST /v1/experiments), their trials, the best one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from trainyard_contract.errors import ConfigError
from trainyard_cli.config import load_spec
from trainyard_cli.console import error, stdout

experiments_app = typer.Typer(
    help="Sweeps: a base spec, a search space over its fields, early stopping of the losers; each trial an "
         "ordinary job (docs/experiments.md).", no_args_is_help=True)

ExperimentArg = Annotated[str, typer.Argument(help="experiment id (exp-…)")]
JsonFlag = Annotated[bool, typer.Option("--json", help="print the API's JSON instead of a table")]

CREATE_HELP = """Start an experiment from a sweep file (YAML or JSON; - reads stdin).

The file names: name; base (a training spec, inline or the path of a spec file, relative to the sweep file); space (spec field → {low, high, log, type: float|int} or {type: categorical, values: […]}); search ({algorithm: random|grid|tpe, seed}); metric ({name: loss, goal: minimize}); earlyStopping ({kind: successiveHalving, minSteps, reductionFactor}); budget ({maxTrials, maxDeviceHours}); maxConcurrentTrials. The API checks the base and a trial's spec as it checks a submission: a problem is named base.<field> or space.<field>.

Example: examples/sweep/sweep.yaml (six learning rates for the tiny built-in GPT, the worst stopped at steps 30 and 90):

  name: lr-sweep
  base: {…a training spec…}     # or the path of a spec file: base: ../tiny.yaml
  space: {training.learningRate: {low: 0.0003, high: 0.03, log: true}}
  earlyStopping: {minSteps: 30, reductionFactor: 3}
  budget: {maxTrials: 6}

Your own code: a base with code (base: ../gpt-sdk/spec.yaml) and --code examples/gpt-sdk.
"""  # noqa: E501 - help text: a paragraph per line, typer wraps it


def load_sweep(path: Path) -> dict[str, Any]:
    """The sweep file, its ``base`` read from the spec file it names (relative to the sweep file)."""
    sweep = load_spec(path, sys.stdin.read() if str(path) == "-" else None)
    base = sweep.get("base")
    if isinstance(base, str):
        where = (Path.cwd() if str(path) == "-" else path.parent) / base
        sweep["base"] = load_spec(where)
    return sweep


@experiments_app.command("create", help=CREATE_HELP)
def experiments_create(
    ctx: typer.Context,
    sweep: Annotated[Path, typer.Argument(metavar="SWEEP", help="the sweep file (YAML or JSON; - reads stdin)")],
    code: Annotated[Path | None, typer.Option(
        "--code", metavar="DIR", show_default=False, file_okay=False, exists=True,
        help="your training code: packed, uploaded unless the API has it, and named in the base's code.archive "
             "(as `trainyard submit --code`)")] = None,
    as_json: JsonFlag = False,
) -> None:
    from rich.text import Text

    from trainyard_cli.main import _api, _with_uploaded_code

    try:
        body = load_sweep(sweep)
    except ConfigError as exc:
        error(exc.message)
        raise typer.Exit(2) from None
    if not isinstance(body.get("base"), dict):
        error("the sweep file needs base: a training spec, inline or the path of a spec file")
        raise typer.Exit(2)
    with _api(ctx, what="experiment") as client:
        if code is not None:
            body["base"] = _with_uploaded_code(client, body["base"], code, None)
        created = client.call_json("POST", "/v1/experiments", body=body)
    if as_json:
        typer.echo(json.dumps(created, indent=2))
        return
    trials = created["spec"]["budget"]["maxTrials"]
    stdout().print(Text.assemble("created experiment ", (created["experimentId"], "bold"),
                                 f" ({created['name']}): {trials} trials, {created['spec']['maxConcurrentTrials']} "
                                 f"at a time; follow it with `trainyard experiments show {created['experimentId']}`"))


@experiments_app.command("list")
def experiments_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Your tenant's experiments, oldest first: state, trials, best value."""
    from rich.table import Table

    from trainyard_cli.main import _api

    with _api(ctx) as client:
        items = client.call_json("GET", "/v1/experiments")["experiments"]
    if as_json:
        typer.echo(json.dumps(items, indent=2))
        return
    table = Table("EXPERIMENT", "NAME", "STATE", "TRIALS", "BEST", "DEVICE-H")
    for e in items:
        done = sum(1 for t in e["trials"] if t["state"] in ("completed", "stopped", "failed"))
        best = e.get("best") or {}
        table.add_row(e["experimentId"], e["name"], e["state"], f"{done}/{e['spec']['budget']['maxTrials']}",
                      _number(best.get("value")), f"{e['deviceHours']:.3f}")
    stdout().print(table)


@experiments_app.command("show")
def experiments_show(ctx: typer.Context, experiment_id: ExperimentArg, as_json: JsonFlag = False) -> None:
    """An experiment's trials (point, state, the metric at each rung, last value, job, why it stopped) and,
    once it is over, the best trial and its checkpoint."""
    from trainyard_cli.main import _api

    with _api(ctx) as client:
        e = client.call_json("GET", f"/v1/experiments/{experiment_id}")
    if as_json:
        typer.echo(json.dumps(e, indent=2))
        return
    stdout().print(experiment_detail(e))


@experiments_app.command("stop")
def experiments_stop(ctx: typer.Context, experiment_id: ExperimentArg) -> None:
    """Stop the search: running trials checkpoint and stop, no new trial starts."""
    from trainyard_cli.main import _api

    with _api(ctx) as client:
        e = client.call_json("POST", f"/v1/experiments/{experiment_id}/stop")
    stdout().print(f"stopping {e['experimentId']} ({e['name']}): its running trials checkpoint and stop")


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}"


def experiment_detail(e: dict[str, Any]) -> Any:
    """The experiment as a header, a table of trials with a bar per value, and the best trial."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    goal = e["spec"]["metric"]["goal"]
    metric = e["spec"]["metric"]["name"]
    values = [t["value"] for t in e["trials"] if t.get("value") is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    table = Table("#", *sorted(e["spec"]["space"]), "STATE", *[f"@{s}" for s in e["rungs"]], metric.upper(), "",
                  "JOB", "WHY")
    for t in e["trials"]:
        value = t.get("value")
        share = 0.0 if value is None or hi == lo else (value - lo) / (hi - lo)
        good = 1 - share if goal == "minimize" else share
        bar = "█" * max(1, round(good * 12)) if value is not None else ""
        rungs = [_number(t["rungs"][k]) if k < len(t["rungs"]) else "" for k in range(len(e["rungs"]))]
        table.add_row(str(t["number"]), *[_param(t["params"].get(p)) for p in sorted(e["spec"]["space"])],
                      t["state"], *rungs, _number(value), bar, t.get("jobId") or "-", t.get("reason") or "")
    head = Text.assemble((e["experimentId"], "bold"), f" {e['name']}: {e['state']}",
                         f" ({e['reason']})" if e.get("reason") else "",
                         f" · {e['deviceHours']:.3f} device-hours · {metric} ({goal})")
    parts: list[Any] = [head, table]
    if best := e.get("best"):
        parts.append(Text.assemble("best: trial ", (str(best["trial"]), "bold"), f" {best['params']} "
                                   f"{metric} {_number(best['value'])}, job {best['jobId']}",
                                   f", checkpoint {best['checkpoint']} (step {best['globalStep']})"
                                   if best.get("checkpoint") else ""))
    return Group(*parts)


def _param(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
