"""`trainyard dev …`: run the embedded local stack on this host (what `make up`, `make down`,
`make logs`, `make data` and `make demo` call)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import typer
from rich.text import Text

from trainyard_cli.client import ApiClient
from trainyard_cli.console import error, stderr, stdout
from trainyard_cli.tables import Col, Fitted
from trainyard_cli.stack import LocalStack, StackSettings
from trainyard_contract.errors import DataError, TrainyardError
from trainyard_contract.records import NodeRecord

dev_app = typer.Typer(
    help="Run the local stack on this host: a Kafka-protocol broker, Redis, the five services "
    "and simulated nodes (CPU ranks, gloo). Configure with TRAINYARD_* variables "
    "(TRAINYARD_KAFKA_PORT, TRAINYARD_REDIS_PORT, TRAINYARD_API_PORT, TRAINYARD_NODES, "
    "TRAINYARD_DEVICES_PER_NODE, TRAINYARD_STATE_DIR, TRAINYARD_DRAIN_TIMEOUT_S: how long `down` lets running "
    "jobs checkpoint and stop; TRAINYARD_PROMETHEUS=1: also run Prometheus over every service and node agent).",
    no_args_is_help=True,
)
EXAMPLE_SPEC = Path("examples/tiny.yaml")
STATUS_COLUMNS = (Col("component", keep=100), Col("pid", keep=50, justify="right"), Col("state", keep=90),
                  Col("log", "middle", keep=70, min_width=24))
DATASET = ("tinycorpus", "v1")


def _stack() -> LocalStack:
    return LocalStack(StackSettings(), say=lambda m: stderr().print(Text.assemble(("•", "dim"), " ", m)))


def _fail(exc: Exception) -> typer.Exit:
    error(str(exc))
    return typer.Exit(2)


def node_line(node: NodeRecord) -> str:
    """What `make up` says about a node: devices, confinement, warm interpreters."""
    kinds = sorted({d.type for d in node.devices})
    warm = ("warm interpreters: unknown (an older agent)" if node.warm_interpreters is None else
            f"{node.warm_interpreters} warm interpreter(s) for fast restarts" if node.warm_interpreters else
            "no warm interpreters (ranks start cold)")
    return (f"{node.node_id}: {len(node.devices)} {'/'.join(kinds) or 'no'} device(s), ranks "
            f"{'sandboxed' if node.sandbox == 'enforce' else 'UNSANDBOXED' if node.sandbox else 'confined: unknown'}, "
            f"{warm} (TRAINYARD_WARM_RANKS; default: one per device, sized to memory)")


@dev_app.command()
def up() -> None:
    """Start everything (idempotent), wait until healthy, publish the example dataset (tinycorpus@v1,
    built once), print the API URL and a dev token."""
    stack = _stack()
    try:
        token = stack.up()
        ref = prepare_and_publish(stack)
    except TrainyardError as exc:
        raise _fail(exc) from None
    console = stderr()
    console.print(Text.assemble(("trainyard is up", "green"), f"  API {stack.s.api_url}   example dataset {ref}"))
    for node in stack.nodes():
        console.print(f"  {node_line(node)}")
    console.print(f"dev token (tenant 'dev', tenant-admin): {token}   (also in {stack.token_file})")
    console.print(f"dashboard: {stack.s.api_url}/ui/  (sign in with the dev token; docs/dashboard.md)")
    if stack.prometheus_url:
        console.print(f"prometheus: {stack.prometheus_url}  (every service and node agent; rules from "
                      "deploy/prometheus/rules; docs/production.md#monitoring)")
    if stack.admin_token_file.exists():
        console.print(f"platform-admin token: in {stack.admin_token_file} (`trainyard admin …` uses it)")
    console.print(Text.assemble("next: ", ("make demo", "bold"), ", or ",
                                ("trainyard submit examples/tiny.yaml --follow", "bold")))


@dev_app.command()
def down() -> None:
    """Stop exactly what `up` started (by pid). Running jobs are drained first: their ranks checkpoint at an
    agreed step and stop (up to TRAINYARD_DRAIN_TIMEOUT_S, 120 s), interrupted by maintenance — no failure,
    no blame — and resume from that checkpoint by themselves after `up`."""
    stopped = _stack().down()
    stderr().print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@dev_app.command()
def status() -> None:
    """Show the components of the local stack and whether they run."""
    stack = _stack()
    table = Fitted(None, STATUS_COLUMNS, hint="the log paths are in the stack's state directory")
    for c in stack.components():
        table.add_row(c.name, str(c.pid), Text("running", style="green") if c.alive else Text("dead", style="red"),
                      str(c.log))
    stdout().print(table)


@dev_app.command()
def logs(
    name: str = typer.Argument(None, help="one component (api, scheduler, node-agent-0, broker, …); all if omitted"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
    lines: int = typer.Option(40, "--lines", "-n", help="lines per log"),
) -> None:
    """Show the local stack's logs."""
    log_dir = _stack().s.log_dir
    files = sorted(log_dir.glob(f"{name}.log" if name else "*.log"))
    if not files:
        raise _fail(FileNotFoundError(f"no logs in {log_dir}" + (f" named {name}" if name else "")))
    cmd = ["tail", f"-n{lines}"] + (["-F"] if follow else []) + [str(f) for f in files]
    raise typer.Exit(subprocess.call(cmd))  # noqa: S603 - tail on our own log files


@dev_app.command()
def data() -> None:
    """Build the example dataset (tinycorpus@v1) if needed and publish it to the registry."""
    try:
        ref = prepare_and_publish(_stack())
    except TrainyardError as exc:
        raise _fail(exc) from None
    stderr().print(f"dataset {ref} is registered")


def prepare_and_publish(stack: LocalStack, timeout_s: float = 60.0) -> str:
    """Prepare tinycorpus@v1 under the artifact root (built in the stack's directory and uploaded, when the
    root is an object store: TRAINYARD_ARTIFACT_STORE), publish DatasetVersionPublished, and wait until the
    registry has recorded it."""
    from trainyard_contract.storage import ArtifactLayout, path_to_uri
    from trainyard.data import MANIFEST_FILE, prepare_dataset, upload_dataset

    name, version = DATASET
    if not (ArtifactLayout(stack.s.artifact_root).dataset_dir(name, version) / MANIFEST_FILE).exists():
        stderr().print(f"preparing dataset {name}@{version} once (real text, trained byte-level BPE)…")
    manifest_path, manifest_sha, manifest = prepare_dataset(stack.s.artifact_root, name, version)
    manifest_uri = path_to_uri(manifest_path)
    if stack.s.artifact_store:
        store = ArtifactLayout(stack.s.artifact_store).dataset_dir(name, version)
        manifest_uri = str(upload_dataset(manifest_path.parent, store))  # type: ignore[arg-type]  # an object store
    asyncio.run(_publish_dataset(stack, manifest_uri, manifest_sha, manifest))
    return f"{name}@{version}"


async def _publish_dataset(stack: LocalStack, manifest_uri: str, manifest_sha: str, manifest: object) -> None:
    from trainyard_runtime.bus import Bus
    from trainyard_contract.events import DatasetVersionPublished
    from trainyard_runtime.store import StateStore, connect_redis

    name, version = DATASET
    redis = connect_redis(stack.redis_url)
    store = StateStore(redis)
    try:
        existing = await store.get_dataset(f"{name}@{version}")
        if existing and existing.sha256 == manifest_sha:
            return
        event = DatasetVersionPublished(
            name=name, version=version, manifest_uri=manifest_uri, sha256=manifest_sha,
            tokenizer=getattr(manifest, "tokenizer_version", None) or _tokenizer_version(manifest),
            num_tokens=getattr(manifest, "num_tokens", None),
        )
        async with Bus(stack.kafka_bootstrap, service_name="cli", topic_namespace=stack.s.topic_namespace) as bus:
            await bus.publish(event)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if await store.get_dataset(f"{name}@{version}"):
                return
            refused = await store.get_dataset_rejection(f"{name}@{version}")
            if refused is not None and refused.published_event_id == str(event.event_id):
                raise DataError(f"the registry refused {name}@{version} ({manifest_uri}): {refused.reason}: "
                                + "; ".join(refused.problems))
            await asyncio.sleep(0.3)
        raise TimeoutError("the registry did not record the dataset within 60 s; is it running? (`make logs registry`)")
    finally:
        await redis.aclose()


def _tokenizer_version(manifest: object) -> str | None:
    tok = getattr(manifest, "tokenizer", None)
    return getattr(tok, "version", None) if tok is not None else None


@dev_app.command()
def demo(
    spec_path: Path = typer.Option(EXAMPLE_SPEC, "--spec", help="the job to run"),
    timeout_s: float = typer.Option(600.0, "--timeout", help="give up following after this many seconds"),
) -> None:
    """Run the example job on the running stack and print its READY checkpoint and registry artifact.

    Prepares the dataset if needed, submits the spec, follows it with a progress bar to the end.
    """
    from trainyard_cli.config import load_spec
    from trainyard_cli.follow import follow_job

    console = stderr()
    stack = _stack()
    if not stack.running():
        raise _fail(RuntimeError("the local stack is not running: run `make up` first (or `make demo`)"))
    try:
        prepare_and_publish(stack)
        token = stack.token_file.read_text().strip()
        spec = load_spec(spec_path)
        with ApiClient(stack.s.api_url, token) as client:
            submitted = client.submit(spec)
            console.print(Text.assemble("submitted ", (submitted.job_id, "bold"),
                                        f" (specHash {submitted.spec_hash})"))
            code = follow_job(client, submitted.job_id, console=console, timeout_s=timeout_s)
            job = client.get_job(submitted.job_id)
            if code != 0:
                console.print(Text.assemble((f"job {job.job_id} ended {job.state}", "red"), f": {job.reason or ''}"))
                console.print(f"rank logs: {stack.s.artifact_root}/tenants/*/jobs/{job.job_id}/attempts/*/logs/")
                raise typer.Exit(code)
            _print_outcome(client, job.job_id)
    except TrainyardError as exc:
        raise _fail(exc) from None


def _print_outcome(client: ApiClient, job_id: str) -> None:
    from trainyard_contract.storage import uri_to_path

    ready = [c for c in client.checkpoints(job_id) if c.state == "READY"]
    final = max(ready, key=lambda c: c.global_step)
    manifest = uri_to_path(final.manifest_uri)  # type: ignore[arg-type]  # a READY checkpoint has one
    console = stderr()
    console.print(f"job {job_id} succeeded", style="green")
    console.print(f"READY checkpoint at step {final.global_step}: {manifest}")
    print(manifest.read_text(), flush=True)
    for art in client.artifacts(job_id):
        if art.type == "model":
            console.print(Text.assemble("registry artifact ", (art.artifact_id, "bold"), f" ({art.type}) {art.uri}"))
            console.print(f"  hash {art.hash}")
            print(json.dumps({"lineage": art.lineage}, indent=2), flush=True)
