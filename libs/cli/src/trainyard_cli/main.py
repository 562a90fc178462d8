"""``trainyard``: submit and follow training jobs; ``trainyard dev …`` runs the local stack.

Starting is most of what a command costs, so this module imports only typer and the configuration at its
top: the API client (httpx, pydantic, the platform's models), rich's tables and progress bars are imported
in the commands that use them, and the ``models``, ``dev``, ``admin`` and ``plan`` groups when a command
line reaches them (groups.py). ``test_cli_start`` asserts what ``--help`` does not import.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from trainyard_contract.errors import ConfigError

from trainyard_cli.config import CliConfig, load_spec, resolve_admin_token, resolve_api_url, resolve_token
from trainyard_cli.console import error, stderr, stdout, warning
from trainyard_cli.groups import Lazy, LazyGroup

if TYPE_CHECKING:
    from trainyard_cli.client import ApiClient


class _Trainyard(LazyGroup):
    """The root group; its help for each lazy group is that group's own (a test keeps them equal)."""

    lazy = {
        "models": Lazy("trainyard_cli.models:models_app",
                       "Hugging Face model directories in your tenant's prefix, to start jobs from "
                       "(initFrom.huggingFace)."),
        "dev": Lazy("trainyard_cli.devstack:dev_app",
                    "Run the local stack on this host: a Kafka-protocol broker, Redis, the five services and simulated "
                    "nodes (CPU ranks, gloo). Configure with TRAINYARD_* variables (TRAINYARD_KAFKA_PORT, "
                    "TRAINYARD_REDIS_PORT, TRAINYARD_API_PORT, TRAINYARD_NODES, TRAINYARD_DEVICES_PER_NODE, "
                    "TRAINYARD_STATE_DIR, TRAINYARD_DRAIN_TIMEOUT_S: how long `down` lets running jobs checkpoint "
                    "and stop; TRAINYARD_PROMETHEUS=1: also run Prometheus over every service and node agent)."),
        "admin": Lazy("trainyard_cli.admin:admin_app",
                      "Administration through the API: tenants (quotas, priority), tokens (roles, expiry, "
                      "revocation), the audit log, nodes. Uses .trainyard/admin-token when present."),
        "experiments": Lazy("trainyard_cli.experiments:experiments_app",
                            "Sweeps: a base spec, a search space over its fields, early stopping of the losers; "
                            "each trial an ordinary job (docs/experiments.md)."),
        "plan": Lazy("trainyard_cli.plan:plan_app",
                     "Capacity planning before you train: memory per device, compute, communication, pipeline "
                     "bubble, checkpoint interval, and ranked layouts. Runs locally; --json for machines."),
    }


class _Program(typer.Typer):
    """The ``trainyard`` program: called (``app()``, the console script), it runs as its own process."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # httpcore imports trio when it is installed (to serve async code under trio), a tenth of a second of
        # every command's start; this process is synchronous, so trio counts as absent here (an import of it
        # raises ImportError, which httpcore expects). Not done on import: a test or library keeps its trio.
        sys.modules.setdefault("trio", None)  # type: ignore[arg-type]  # None blocks the import, as documented
        return super().__call__(*args, **kwargs)


app = _Program(
    name="trainyard",
    help="Submit, watch and control LLM training jobs on trainyard.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=_Trainyard,
)
jobs_app = typer.Typer(help="List, inspect, follow and control jobs.", no_args_is_help=True)
artifacts_app = typer.Typer(help="Registry artifacts (checkpoints, final models, exports) with lineage.",
                            no_args_is_help=True)
datasets_app = typer.Typer(help="Datasets published to the registry.", no_args_is_help=True)
triggers_app = typer.Typer(
    help="Data lands, training starts: a trigger submits a job from a template for each new verified version "
         "of a dataset whose name matches (docs/triggers.md).", no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")
app.add_typer(artifacts_app, name="artifacts")
app.add_typer(datasets_app, name="datasets")
app.add_typer(triggers_app, name="triggers")

UPLOAD_PROGRESS_BYTES = 4 * 2**20
"""Uploads smaller than this show no progress bar (they take a moment)."""

JsonFlag = Annotated[bool, typer.Option("--json", help="print the API's JSON instead of a table")]
JobArg = Annotated[str, typer.Argument(help="job id (job-…)")]


@app.callback()
def _global_options(
    ctx: typer.Context,
    api_url: Annotated[str | None, typer.Option(
        "--api-url", envvar="TRAINYARD_API_URL", show_default=False,
        help="API base URL (default: the contents of .trainyard/api-url if present, else "
             "http://127.0.0.1:8080)")] = None,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="TRAINYARD_TOKEN", show_default=False,
        help="API token (default: the contents of .trainyard/dev-token if present, which `make up` writes; "
             "`trainyard admin …` prefers .trainyard/admin-token)")] = None,
) -> None:
    cwd = Path.cwd()
    ctx.obj = CliConfig(api_url=resolve_api_url(api_url, cwd), token=resolve_token(token, cwd),
                        admin_token=resolve_admin_token(token, cwd))


@contextmanager
def _api(ctx: typer.Context, *, admin: bool = False, what: str = "spec") -> Iterator[ApiClient]:
    """An API client for the command (``admin``: with the admin token, see config.py); see session.py."""
    from trainyard_cli.session import api_session

    with api_session(ctx.obj, admin=admin, what=what) as client:
        yield client


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


# ----------------------------------------------------------------------------- submit


SUBMIT_HELP = """Submit a training job (prints the job id; with --follow, exits 0 only if it succeeds).

With --code DIR your own training code runs instead of the built-in trainer, pinned by content: DIR is packed into a deterministic .tar.gz (the same files always make the same archive), uploaded unless the API has it already, and the spec's code.archive names its sha256. Each rank runs --entrypoint (or the spec's code.entrypoint) in the tree, with RANK, WORLD_SIZE, MASTER_ADDR/PORT and TRAINYARD_* set.

Which files: in a git checkout, what `git ls-files --cached --others --exclude-standard` lists (tracked and untracked files, .gitignore respected), and code.commit / code.dirty record HEAD and whether the checkout had uncommitted changes; outside git, every .gitignore in the tree is honoured. .git, .venv, __pycache__ and .trainyard are never packed. An archive over 100 MiB is refused before uploading, with the largest files listed: .gitignore them.

Your own packages: a lock at the top of DIR — pylock.toml, uv.lock, requirements.lock, or requirements.txt with hashes (or the one --environment names) — becomes the job's code.environment, pinned by its sha256: each node installs those packages once over its own torch and SDK and every rank imports them (docs/sdk.md, "Your environment"). --environment none runs without one.

Without --code a spec may name code.repo + code.revision (a git URL, or a path on the API's machine): the API resolves the revision to a commit and archives it itself.
"""  # noqa: E501 - help text: a paragraph per line, typer wraps it


@app.command(help=SUBMIT_HELP)
def submit(
    ctx: typer.Context,
    spec_file: Annotated[Path, typer.Argument(metavar="SPEC", help="the training spec, YAML or JSON (- reads stdin)")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="show progress until the job ends")] = False,
    idempotency_key: Annotated[str | None, typer.Option(
        "--idempotency-key", help="resubmitting with the same key returns the same job")] = None,
    code: Annotated[Path | None, typer.Option(
        "--code", metavar="DIR", show_default=False,
        help="pack and upload DIR as the job's code (respects .gitignore; see above)")] = None,
    entrypoint: Annotated[str | None, typer.Option(
        "--entrypoint", metavar="COMMAND", show_default=False,
        help='what each rank runs in the code tree, split like a shell: "python train.py --lr 3e-4" '
             "(default: the spec's code.entrypoint)")] = None,
    environment: Annotated[str | None, typer.Option(
        "--environment", metavar="LOCK", show_default=False,
        help="the lock file in DIR the job's packages are installed from (default: pylock.toml, uv.lock, "
             "requirements.lock or a hashed requirements.txt at the top of DIR; none: no environment)")] = None,
) -> None:
    from rich.text import Text

    from trainyard_cli import codepack
    from trainyard_cli.follow import follow_job

    spec = _load(spec_file)
    if entrypoint is not None and code is None and not (spec.get("code") or {}).get("repo"):
        error("--entrypoint needs --code DIR (or code.repo in the spec)")
        raise typer.Exit(2)
    if environment is not None and code is None:
        error("--environment needs --code DIR (with code.repo, name the lock in the spec's code.environment.lock)")
        raise typer.Exit(2)
    with _api(ctx) as client:
        if code is not None:
            spec = _with_uploaded_code(client, spec, code, entrypoint, environment)
        elif entrypoint is not None:
            spec = {**spec, "code": {**spec["code"], "entrypoint": codepack.command(entrypoint)}}
        submitted = client.submit(spec, idempotency_key=idempotency_key)
        stdout().print(Text.assemble("submitted ", (submitted.job_id, "bold"),
                                     f" ({submitted.state}, {submitted.spec_hash})"))
        for message in submitted.warnings or []:
            warning(message)
        if follow:
            raise typer.Exit(follow_job(client, submitted.job_id, console=stderr()))


def _with_uploaded_code(client: ApiClient, spec: dict[str, Any], directory: Path,
                        entrypoint: str | None, environment: str | None = None) -> dict[str, Any]:
    """Pack ``directory``, upload it unless the API has it, and name it in the spec's code."""
    from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TransferSpeedColumn

    from trainyard_cli import codepack
    from trainyard_contract import codetree

    err = stderr()
    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), console=err,
                  transient=True) as bar:
        bar.add_task(f"packing {directory}", total=None)
        selection = codepack.select(directory)
        data = codepack.pack(selection)
    archive = codetree.archive_id(data)
    named = environment or ((spec.get("code") or {}).get("environment") or {}).get("lock")
    try:
        choice = codepack.find_lock(selection, named)
    except ConfigError as exc:
        error(exc.message)
        raise typer.Exit(2) from None
    if choice.note:
        warning(choice.note)
    if choice.lock is not None:
        err.print(f"environment {choice.lock.path} {choice.lock.sha256[:19]}… ({choice.lock.packages} packages, "
                  "installed on each node over its torch and SDK)")
    spec = codepack.with_code(spec, archive=archive, selection=selection, entrypoint=entrypoint, lock=choice.lock)
    dirty = " (dirty)" if selection.dirty else ""
    state = "" if selection.commit is None else f", commit {selection.commit[:12]}{dirty}"
    if client.code_archive(archive) is not None:
        err.print(f"code {archive[:19]}… already uploaded ({len(selection.files)} files{state})")
        return spec
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=err, transient=True, disable=len(data) < UPLOAD_PROGRESS_BYTES) as bar:
        task = bar.add_task("uploading code", total=len(data))
        client.upload_code(archive, data, progress=lambda sent: bar.update(task, completed=sent))
    err.print(f"code {archive[:19]}… uploaded ({len(selection.files)} files, {len(data) / 2**20:.1f} MiB{state})")
    return spec


def _load(spec_file: Path) -> dict[str, Any]:
    try:
        return load_spec(spec_file, sys.stdin.read() if str(spec_file) == "-" else None)
    except ConfigError as exc:
        error(exc.message)
        raise typer.Exit(2) from None


# ----------------------------------------------------------------------------- jobs


@jobs_app.command("list")
def jobs_list(
    ctx: typer.Context,
    state: Annotated[str | None, typer.Option(help="queued, running, paused, succeeded, failed or cancelled")] = None,
    limit: Annotated[int, typer.Option(min=1, help="how many")] = 20,
    offset: Annotated[int, typer.Option(min=0, help="skip this many (newest first)")] = 0,
    as_json: JsonFlag = False,
) -> None:
    """The tenant's jobs, newest first."""
    from trainyard_cli.render import jobs_table

    with _api(ctx) as client:
        page = client.list_jobs(state=state, limit=limit, offset=offset)
    if as_json:
        _print_json(page.model_dump(mode="json", by_alias=True))
        return
    stdout().print(jobs_table(page.jobs))
    if page.next_offset is not None:
        stdout().print(f"more: --offset {page.next_offset}", style="dim")


@jobs_app.command("get")
def jobs_get(ctx: typer.Context, job_id: JobArg, as_json: JsonFlag = False) -> None:
    """A job's state, progress, attempts and checkpoints."""
    from trainyard_cli.render import job_detail

    with _api(ctx) as client:
        if as_json:
            _print_json(client.get_json(f"/v1/training-jobs/{job_id}"))
            return
        job = client.get_job(job_id)
    stdout().print(job_detail(job))


@jobs_app.command("follow")
def jobs_follow(
    ctx: typer.Context,
    job_id: JobArg,
    timeout: Annotated[float | None, typer.Option(help="stop following after this many seconds")] = None,
) -> None:
    """Show a progress bar until the job ends (exit 0 if it succeeded)."""
    from trainyard_cli.follow import follow_job

    with _api(ctx) as client:
        raise typer.Exit(follow_job(client, job_id, console=stderr(), timeout_s=timeout))


@jobs_app.command("logs")
def jobs_logs(
    ctx: typer.Context,
    job_id: JobArg,
    rank: Annotated[int, typer.Option(min=0, help="which rank's log")] = 0,
    attempt: Annotated[int | None, typer.Option(min=0, help="which attempt (default: the newest)")] = None,
    tail: Annotated[int, typer.Option(min=0, help="lines from the end")] = 200,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new lines until the attempt ends")]
    = False,
) -> None:
    """A rank's log: its last lines, or followed while the attempt runs."""
    with _api(ctx) as client:
        for chunk in client.logs(job_id, attempt=attempt, rank=rank, tail=tail, follow=follow):
            sys.stdout.write(chunk)
            sys.stdout.flush()


def _control(ctx: typer.Context, job_id: str, action: str) -> None:
    from rich.text import Text

    from trainyard_cli.render import state_text

    with _api(ctx) as client:
        accepted = client.control(job_id, action)
    stdout().print(Text.assemble(f"{action} requested for ", (accepted.job_id, "bold"), " (state now: ",
                                 state_text(accepted.state), ")"))


@jobs_app.command("cancel")
def jobs_cancel(ctx: typer.Context, job_id: JobArg) -> None:
    """Cancel a job (a finished job cannot be cancelled)."""
    _control(ctx, job_id, "cancel")


@jobs_app.command("pause")
def jobs_pause(ctx: typer.Context, job_id: JobArg) -> None:
    """Pause a job: its ranks checkpoint at the next step they agree on, then the gang is released."""
    _control(ctx, job_id, "pause")


@jobs_app.command("resume")
def jobs_resume(ctx: typer.Context, job_id: JobArg) -> None:
    """Resume a paused job from its latest READY checkpoint."""
    _control(ctx, job_id, "resume")


@jobs_app.command("checkpoints")
def jobs_checkpoints(ctx: typer.Context, job_id: JobArg, as_json: JsonFlag = False) -> None:
    """A job's checkpoints: state, global step, tensors hash (equal for runs that saved the same values),
    content hash (the files as written), manifest."""
    from trainyard_cli.render import checkpoints_table

    with _api(ctx) as client:
        items = client.checkpoints(job_id)
    if as_json:
        _print_json([c.model_dump(mode="json", by_alias=True) for c in items])
        return
    stdout().print(checkpoints_table(items, title=f"checkpoints of {job_id}"))


@jobs_app.command("evaluations")
def jobs_evaluations(ctx: typer.Context, job_id: JobArg, as_json: JsonFlag = False) -> None:
    """The evaluations of a job's READY checkpoints (a checkpointReady trigger's evaluation jobs, or ones
    submitted with `evaluation`): step, checkpoint, evaluation job, metrics (docs/triggers.md)."""
    from trainyard_cli.render import evaluations_table

    with _api(ctx) as client:
        items = client.evaluations(job_id)
    if as_json:
        _print_json(items)
        return
    stdout().print(evaluations_table(items, title=f"evaluations of {job_id}"))


# ----------------------------------------------------------------------------- registry


@artifacts_app.command("list")
def artifacts_list(
    ctx: typer.Context,
    job: Annotated[str, typer.Option("--job", help="the job whose artifacts to list")],
    as_json: JsonFlag = False,
) -> None:
    """Artifacts a job produced, with lineage."""
    from trainyard_cli.render import artifacts_table

    with _api(ctx) as client:
        if as_json:
            _print_json(client.get_json("/v1/registry/artifacts", params={"jobId": job}))
            return
        items = client.artifacts(job)
    stdout().print(artifacts_table(items))


EXPORT_HELP = """Export a job's READY checkpoint as a Hugging Face model directory, and download it.

Picks the job's latest READY checkpoint (or the one at --step), asks the registry to convert it (POST /v1/registry/artifacts/{id}/export) and follows the export until it is ready. The registry first verifies every shard against the checkpoint's manifest, then gathers the full model whatever layout it was trained in (DDP, FSDP, tensor or pipeline parallel) and writes config.json (GPT2LMHeadModel or LlamaForCausalLM), model.safetensors, generation_config.json and the dataset's tokenizer (tokenizer.json, tokenizer_config.json). The export is recorded as an artifact (<job>/export/<checkpoint>/hf) with the checkpoint's lineage; asking again for the same checkpoint returns the same export.

With --out DIR every file is downloaded and checked against its sha256 (the listing trainyard-export.json against the export's hash, each file against the listing) before DIR appears; then

    AutoModelForCausalLM.from_pretrained("DIR"); AutoTokenizer.from_pretrained("DIR")

A spec with `export: {format: hf}` is exported like this automatically when the job succeeds.
"""  # noqa: E501 - help text: a paragraph per line, typer wraps it


@app.command("export", help=EXPORT_HELP)
def export_command(
    ctx: typer.Context,
    job_id: JobArg,
    step: Annotated[int | None, typer.Option("--step", min=0, show_default=False,
                                             help="the READY checkpoint at this global step (default: the latest)")
                    ] = None,
    fmt: Annotated[str, typer.Option("--format", help="hf: a Hugging Face model directory")] = "hf",
    out_dir: Annotated[Path | None, typer.Option("--out", metavar="DIR", show_default=False,
                                                 help="download the export into DIR (must not exist, or be empty)")
                       ] = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="ask for the export and return at once")] = False,
    timeout: Annotated[float | None, typer.Option(help="stop following after this many seconds")] = None,
    as_json: JsonFlag = False,
) -> None:
    from trainyard_cli.export import Exporting, next_steps, pick_checkpoint

    if no_wait and out_dir is not None:
        error("--out waits for the export to download it; leave out --no-wait")
        raise typer.Exit(2)
    with _api(ctx, what="body") as client:
        exporting = Exporting(client, stderr())
        checkpoint = pick_checkpoint(job_id, client.artifacts(job_id), step)
        view = exporting.request(checkpoint, fmt)
        stderr().print(f"export {view.artifact_id} of {checkpoint.artifact_id}: {view.state}")
        if not no_wait:
            view = exporting.follow(view, timeout_s=timeout)
            if out_dir is not None:
                exporting.download(view, out_dir)
    if as_json:
        _print_json(view.model_dump(mode="json", by_alias=True))
    elif no_wait:
        stdout().print(f"follow it: trainyard export {job_id} --step {checkpoint.global_step}")
    else:
        stdout().print(next_steps(view, out_dir.resolve() if out_dir is not None else None))


@datasets_app.command("list")
def datasets_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Verified dataset versions you may train on: your tenant's, the platform's, and those shared with you."""
    from trainyard_cli.render import datasets_table

    with _api(ctx) as client:
        items = client.datasets()
    if as_json:
        _print_json([d.model_dump(mode="json", by_alias=True) for d in items])
        return
    stdout().print(datasets_table(items))


@datasets_app.command("get")
def datasets_get(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(metavar="REF", help="name@version (yours, else the platform's) or "
                                                           "tenant/name@version")],
    sha256: Annotated[str | None, typer.Option(
        "--sha256", metavar="HEX", help="what became of the publish of this manifest sha256")] = None,
    as_json: JsonFlag = False,
) -> None:
    """One dataset version: verified, or (yours) rejected with the reason; for your own, also a publish of it
    the registry refused, such as a re-publish with another sha256."""
    from trainyard_cli.datasets import get_command

    get_command(ctx.obj, ref, sha256, as_json)


@datasets_app.command(
    "import",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def datasets_import(ctx: typer.Context) -> None:
    """Build a dataset version from your files under your tenant's prefix; --publish publishes it (--help: its
    options)."""
    from trainyard_cli.datasets import import_command

    import_command(ctx.obj, list(ctx.args))


# ----------------------------------------------------------------------------- triggers

TriggerArg = Annotated[str, typer.Argument(help="trigger id (trg-…)")]
TRIGGER_CREATE_HELP = """Create a trigger: each new verified version of a dataset whose name matches --dataset submits a job from --template with that version.

--template is a training spec (YAML or JSON, the same as for `trainyard submit`) without dataset: a dataset it names is left out, since each new version fills it in. The API checks it as it checks a submission; a problem is named template.<field>. The job is submitted once per version, however often the version is announced; `trainyard triggers show` lists the jobs it started and, when a version could not start one (say the template no longer validates), why.

Whose datasets: --source own (your tenant's, the default), platform (the platform's, such as tinycorpus), shared (other tenants' shared with yours); repeat it for several.

Evaluation on READY: --job JOB (or --experiment EXP) instead of --dataset makes a checkpointReady trigger: each READY checkpoint of that job (of that experiment's jobs) whose step is a multiple of --every-steps submits --template, an evaluation (a spec with `evaluation: {batches: 8}`, without dataset or initFrom: the trigger sets initFrom to the checkpoint and dataset to the trained job's). `trainyard jobs evaluations JOB` shows the results.
"""  # noqa: E501 - help text: a paragraph per line, typer wraps it


def _trigger_name(glob: str) -> str:
    """The default name: the glob's letters (``wiki-*`` → ``wiki``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "", glob).strip("._-")[:64] or "trigger"


@triggers_app.command("create", help=TRIGGER_CREATE_HELP)
def triggers_create(
    ctx: typer.Context,
    template: Annotated[Path, typer.Option("--template", metavar="SPEC",
                                           help="the job to submit: a training spec, YAML or JSON (- reads stdin)")],
    dataset: Annotated[str | None, typer.Option("--dataset", metavar="GLOB",
                                                help="dataset names to match, a glob: 'wiki-*', tinycorpus")] = None,
    job: Annotated[str | None, typer.Option(
        "--job", metavar="JOB", help="evaluate each READY checkpoint of this job (on: checkpointReady)")] = None,
    experiment: Annotated[str | None, typer.Option(
        "--experiment", metavar="EXP", help="evaluate each READY checkpoint of this experiment's jobs")] = None,
    every_steps: Annotated[int | None, typer.Option(
        "--every-steps", metavar="N", help="only checkpoints whose step is a multiple of N")] = None,
    name: Annotated[str | None, typer.Option(
        help="unique within your tenant (default: the glob's letters, wiki-* → wiki)")] = None,
    source: Annotated[list[str] | None, typer.Option(
        "--source", metavar="own|platform|shared", help="whose datasets (repeatable; default: own)")] = None,
    disabled: Annotated[bool, typer.Option("--disabled", help="create it switched off (it starts nothing)")] = False,
    as_json: JsonFlag = False,
) -> None:
    from rich.text import Text

    spec = _load(template)
    if "dataset" in spec:
        stderr().print(f"note: the template's dataset {spec['dataset']!r} is left out: each new version fills it in")
    spec = {k: v for k, v in spec.items() if k != "dataset"}
    watched = job or experiment
    body: dict[str, Any] = {"name": name or _trigger_name(dataset or watched or ""), "template": spec,
                            "enabled": not disabled}
    if watched is None:
        body |= {"dataset": dataset, "sources": source or ["own"]}
    else:
        body |= {"on": "checkpointReady", "job": job, "experiment": experiment, "everySteps": every_steps,
                 **({"dataset": dataset} if dataset else {})}
    with _api(ctx, what="trigger") as client:
        created = client.create_trigger(body)
    if as_json:
        _print_json(created.model_dump(mode="json", by_alias=True))
        return
    what = (f"new versions of {created.dataset} ({', '.join(created.sources)}) submit its job"
            if created.on != "checkpointReady" else
            f"READY checkpoints of {created.job or 'experiment ' + str(created.experiment)}"
            + (f" every {created.every_steps} steps" if created.every_steps else "") + " submit its evaluation")
    stdout().print(Text.assemble("created trigger ", (created.trigger_id, "bold"), f" ({created.name}): {what}"))


@triggers_app.command("list")
def triggers_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Your tenant's triggers, oldest first, with their last failure."""
    from trainyard_cli.render import triggers_table

    with _api(ctx) as client:
        items = client.triggers()
    if as_json:
        _print_json([t.model_dump(mode="json", by_alias=True) for t in items])
        return
    stdout().print(triggers_table(items))


@triggers_app.command("show")
def triggers_show(ctx: typer.Context, trigger_id: TriggerArg, as_json: JsonFlag = False) -> None:
    """A trigger: what it matches and submits, the jobs it started, its last failure."""
    from trainyard_cli.render import trigger_detail

    with _api(ctx) as client:
        if as_json:
            _print_json(client.get_json(f"/v1/triggers/{trigger_id}"))
            return
        trigger = client.get_trigger(trigger_id)
    stdout().print(trigger_detail(trigger))


@triggers_app.command("delete")
def triggers_delete(ctx: typer.Context, trigger_id: TriggerArg) -> None:
    """Delete a trigger: new versions start nothing more; the jobs it started stay."""
    from rich.text import Text

    with _api(ctx) as client:
        deleted = client.delete_trigger(trigger_id)
    stdout().print(Text.assemble("deleted trigger ", (deleted.trigger_id, "bold"), f" ({deleted.name}); "
                                 f"the {len(deleted.jobs or [])} job(s) it started stay"))


if __name__ == "__main__":
    app()
