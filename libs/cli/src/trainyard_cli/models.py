"""``trainyard models``: bring a Hugging Face model directory into your tenant's prefix of the artifact
store, to start jobs from (``initFrom: {huggingFace: models/<name>}``), and list those there.

The import checks the directory as a submission will (config.json a GPT-2 / Llama trainyard builds
exactly, safetensors weights present: ``trainyard_contract.hfdir``), copies what a model directory
holds (config, weights, tokenizer and generation files; symlinks such as the Hugging Face cache's are
followed) into a temporary sibling and renames it into place, so a model directory is either whole
or absent. An existing model of that name is left alone: the same files are "already imported",
other files are refused (pick another ``--name``).

Under an object-store root (``s3://…``) there is no rename: each file is uploaded under the model's
prefix (hashed as it streams), ``config.json`` last of them — a prefix without it is no model — and then
``trainyard-model.json`` (every file with its size and sha256, a create-only PUT), which marks the
import complete and lets ranks verify what they download. An interrupted import is completed by running
it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)
from trainyard_cli.console import error, stderr
from trainyard_contract.errors import ConfigError, TrainyardError
from trainyard_contract.hfdir import CONFIG_FILE, MODEL_LISTING, HfDir, inline_config, inspect_dir
from trainyard_contract.storage import (
    CHUNK,
    ArtifactLayout,
    Location,
    ObjectPath,
    export_listing,
    fsync_dir,
    is_file,
    list_children,
    read_bytes,
    upload,
    upload_file,
)

models_app = typer.Typer(
    help="Hugging Face model directories in your tenant's prefix, to start jobs from (initFrom.huggingFace).",
    no_args_is_help=True)

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Weight formats trainyard does not read (it reads safetensors only): not copied.
SKIPPED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")
PROGRESS_BYTES = 64 * 2**20  # copies smaller than this show no progress bar


# ----------------------------------------------------------------------------- pure


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name) or name in (".", ".."):
        raise ConfigError(f"--name {name!r}: a model name is letters, digits, . _ - (no /), e.g. llama-tiny-hf")
    return name


def files_to_copy(names: Iterable[str]) -> list[str]:
    """The top-level files of a model directory an import copies: all but other weight formats and hidden ones."""
    return sorted(n for n in names if not n.startswith(".") and not n.endswith(SKIPPED_SUFFIXES))


@dataclass(frozen=True)
class Imported:
    directory: Location
    model: HfDir
    files: dict[str, str]  # name -> sha256
    created: bool  # False: the same model was there already

    def start_snippet(self, name: str) -> str:
        return (f"initFrom: {{huggingFace: models/{name}}}\nmodelConfig: {inline_config(self.model.config)}")


# ----------------------------------------------------------------------------- I/O


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _copy(source: Path, target: Path, advance: Callable[[int], None]) -> str:
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(CHUNK):
            dst.write(chunk)
            digest.update(chunk)
            advance(len(chunk))
        dst.flush()
        os.fsync(dst.fileno())
    return digest.hexdigest()


def _regular_files(directory: Path) -> list[str]:
    return files_to_copy(p.name for p in directory.iterdir() if p.is_file())  # is_file follows symlinks


def import_model(source: Path, layout: ArtifactLayout, tenant: str, name: str, *,
                 advance: Callable[[int], None] = lambda n: None) -> Imported:
    """Check ``source`` and copy it to ``models/<name>`` of ``tenant`` atomically; ConfigError when it cannot
    start a job, or when a different model already has that name."""
    check_name(name)
    model = inspect_dir(Path(source).expanduser().resolve())
    assert isinstance(model.path, Path)
    names = _regular_files(model.path)
    target = layout.model_dir(tenant, name)
    if isinstance(target, ObjectPath):
        return _import_to_store(model, model.path, names, target, name, advance)
    if target.exists():
        return _already(model, names, target, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        files = {n: _copy(model.path / n, tmp / n, advance) for n in names}
        fsync_dir(tmp)
        inspect_dir(tmp)  # what was copied is a usable directory too
        try:
            tmp.rename(target)
        except OSError:  # another import of that name won the race
            if target.exists():
                return _already(model, names, target, name)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    return Imported(target, model, files, created=True)


def _import_to_store(model: HfDir, source: Path, names: list[str], target: ObjectPath, name: str,
                     advance: Callable[[int], None]) -> Imported:
    """Upload the files, config.json last, then the listing (create-only: the first import wins). Each file is
    read once: hashed as it uploads, or, when the model is there already, only hashed to compare."""
    if is_file(target / MODEL_LISTING):
        return _already_in_store(model, {n: _sha256(source / n) for n in names}, target, name)
    listed, mine = [], {}
    for n in sorted(names, key=lambda n: (n == CONFIG_FILE, n)):
        size, mine[n] = upload_file(source / n, target / n)
        listed.append({"name": n, "size": size, "sha256": mine[n]})
        advance(size)
    inspect_dir(target)  # what was uploaded is a usable directory too
    try:
        with upload(target / MODEL_LISTING, exclusive=True) as out:
            out.write(json.dumps({"files": listed}, indent=1).encode())
    except FileExistsError:  # another import of that name finished first
        return _already_in_store(model, mine, target, name)
    return Imported(target, model, mine, created=True)


def _already_in_store(model: HfDir, mine: dict[str, str], target: ObjectPath, name: str) -> Imported:
    theirs = {f.name: f.sha256 for f in export_listing(read_bytes(target / MODEL_LISTING))}
    return _same_or_refused(model, mine, theirs, target, name)


def _already(model: HfDir, names: list[str], target: Path, name: str) -> Imported:
    theirs = {n: _sha256(target / n) for n in _regular_files(target)}
    assert isinstance(model.path, Path)
    mine = {n: _sha256(model.path / n) for n in names}
    return _same_or_refused(model, mine, theirs, target, name)


def _same_or_refused(model: HfDir, mine: dict[str, str], theirs: dict[str, str], target: Location,
                     name: str) -> Imported:
    if theirs != mine:
        differ = sorted(set(theirs) ^ set(mine)) or sorted(n for n in mine if mine[n] != theirs.get(n))
        raise ConfigError(f"a different model is already imported as {name!r} ({target}; {', '.join(differ[:3])} "
                          "differ): choose another --name (a model directory is never overwritten: jobs may "
                          "have started from it)")
    return Imported(target, model, mine, created=False)


def list_models(layout: ArtifactLayout, tenant: str) -> list[tuple[str, HfDir | ConfigError]]:
    """Every directory under the tenant's ``models/``: what it holds, or why it cannot start a job."""
    base = layout.tenant_dir(tenant) / "models"
    found: list[tuple[str, HfDir | ConfigError]] = []
    for entry in sorted(c.name for c in list_children(base) if c.is_dir and not c.name.startswith(".")):
        try:
            found.append((entry, inspect_dir(base / entry)))
        except ConfigError as exc:
            found.append((entry, exc))
    return found


# ----------------------------------------------------------------------------- commands


def _default_root() -> Location:
    from trainyard_contract.settings import ServiceSettings, load_settings

    return load_settings(ServiceSettings).artifact_root_abs


def _tenant(ctx: typer.Context, tenant: str | None) -> str:
    if tenant is not None:
        return tenant
    from trainyard_cli.client import ApiClient

    config = ctx.obj
    try:
        with ApiClient(config.api_url, config.require_token()) as client:
            found = client.caller_tenant()
    except TrainyardError as exc:  # the client raises the tree (client.py): any reason the API cannot say
        raise ConfigError(f"cannot ask the API for your token's tenant ({exc}): pass --tenant") from None
    if found is None:
        raise ConfigError("the API did not say which tenant your token belongs to: pass --tenant")
    return found


RootOption = Annotated[str | None, typer.Option(
    "--artifact-root", show_default=False,
    help="the artifact store's root: a directory or s3://bucket/prefix (default: TRAINYARD_ARTIFACT_ROOT, else "
         ".trainyard/artifacts)")]
TenantOption = Annotated[str | None, typer.Option(
    "--tenant", show_default=False, help="whose prefix (default: your token's tenant, asked of the API)")]


@models_app.command("import")
def models_import(
    ctx: typer.Context,
    source: Annotated[Path, typer.Argument(help="a local Hugging Face model directory (save_pretrained, an export)")],
    name: Annotated[str, typer.Option("--name", help="the model's name under models/ (letters, digits, . _ -)")],
    tenant: TenantOption = None,
    artifact_root: RootOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead")] = False,
) -> None:
    """Copy a GPT-2 / Llama directory (config.json, safetensors) into tenants/<tenant>/models/<name>.

    It is checked first as a submission checks initFrom.huggingFace; prints the initFrom and the
    modelConfig (the directory's shape, inline) to put in a spec."""
    try:
        check_name(name)
        owner = _tenant(ctx, tenant)
        layout = ArtifactLayout(artifact_root or _default_root())
        model = inspect_dir(source.expanduser().resolve())
        total = sum(size for _, size in model.weight_files)
        with Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                      TransferSpeedColumn(), console=stderr(), transient=True, disable=total < PROGRESS_BYTES) as bar:
            task = bar.add_task(f"importing {name}", total=total)
            done = import_model(source, layout, owner, name, advance=lambda n: bar.advance(task, n))
    except ConfigError as exc:
        error(exc.message)
        raise typer.Exit(2) from None
    except OSError as exc:
        error(f"cannot copy {source}: {exc}")
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps({"name": name, "tenant": owner, "directory": str(done.directory),
                               "created": done.created, "initFrom": {"huggingFace": f"models/{name}"},
                               "modelConfig": json.loads(inline_config(done.model.config)), "files": done.files}))
        return
    what = "imported" if done.created else "already imported (the same files)"
    stderr().print(f"{what}: {done.directory} ({len(done.files)} files, {total / 2**20:.1f} MiB of weights)")
    typer.echo(done.start_snippet(name))


@models_app.command("list")
def models_list(ctx: typer.Context, tenant: TenantOption = None, artifact_root: RootOption = None) -> None:
    """The model directories under your tenant's models/, with their shapes (or why one cannot start a job)."""
    try:
        owner = _tenant(ctx, tenant)
    except ConfigError as exc:
        error(exc.message)
        raise typer.Exit(2) from None
    for name, found in list_models(ArtifactLayout(artifact_root or _default_root()), owner):
        if isinstance(found, ConfigError):
            typer.echo(f"models/{name}\tunusable: {found.message}")
        else:
            c = found.config
            typer.echo(f"models/{name}\t{c.architecture} {c.n_layers}x{c.d_model} vocab {c.vocab_size} "
                       f"({c.num_parameters / 1e6:.1f}M parameters)")
