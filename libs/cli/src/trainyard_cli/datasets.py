"""``trainyard datasets import`` and ``trainyard datasets get``: your tenant's dataset versions.

``import`` is ``trainyard-data import`` run as your token's tenant: the version is written under that tenant's
prefix (``tenants/<tenant>/datasets/<name>/<version>/``), with or without ``--publish`` — never under the
platform's ``datasets/``, where a platform import of the same name would collide with it. The tenant comes from
the API (the token's), not from an option: building another tenant's or a platform version is an operator's
``trainyard-data import [--tenant T]``. With ``--publish`` the version is then announced (POST /v1/datasets) and
the registry's verdict on *this* publish is awaited (the 202's ``?sha256=`` view): verified, or rejected with
the reason — exit 0 only when verified.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer

from trainyard_cli.console import error, stderr
from trainyard_cli.session import EXIT_CONFIG, EXIT_REFUSED, api_session

if TYPE_CHECKING:
    from trainyard_cli.client import ApiClient, DatasetView
    from trainyard_cli.config import CliConfig

IMPORT_PROG = "trainyard datasets import"
IMPORT_DESCRIPTION = """\
Build a dataset version from your files (.txt/.jsonl/.parquet, .gz/.zst; directories, globs, fsspec URLs) and
a Hugging Face tokenizer.json (or one trained on them), under your token's tenant's prefix of the artifact root:
tenants/<tenant>/datasets/<name>/<version>/ (the tenant is asked of the API). Prints one JSON object
(manifestUri, sha256, tokenizer, numTokens, documents, …).

With --publish it then publishes the version (POST /v1/datasets) and waits for the registry's verdict on this
publish: verified (exit 0) or rejected with the reason (exit 1). A version is immutable: publishing other
content under a name@version already verified is refused. docs/datasets.md has the details.
"""
IMPORT_EPILOG = ("Offline, or for the platform's datasets/ or another tenant's prefix (an operator's task): "
                 "trainyard-data import [--tenant T].")
DEFAULT_WAIT_S = 600.0


def import_parser(default_root: Any) -> argparse.ArgumentParser:
    """The command's own options: the import's (as trainyard-data's) and the publishing ones."""
    from trainyard_trainer.data_cli import add_import_arguments, add_version_arguments

    parser = argparse.ArgumentParser(prog=IMPORT_PROG, description=IMPORT_DESCRIPTION, epilog=IMPORT_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version_arguments(parser, default_root, required=True)
    add_import_arguments(parser)
    publishing = parser.add_argument_group("publishing")
    publishing.add_argument("--publish", action="store_true",
                            help="then publish it (POST /v1/datasets); the registry verifies it before any job "
                                 "may use it")
    publishing.add_argument("--share", action="append", default=[], metavar="TENANT",
                            help="with --publish: another tenant that may train on it (repeatable; '*': every "
                                 "tenant)")
    publishing.add_argument("--no-wait", action="store_true",
                            help="with --publish: do not wait for the registry's verdict")
    publishing.add_argument("--wait-timeout", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                            help=f"with --publish: how long to wait for it (default: {DEFAULT_WAIT_S:.0f})")
    return parser


def import_command(config: CliConfig, argv: list[str]) -> None:
    """``trainyard datasets import ARGV``: build as the token's tenant, then maybe publish and follow."""
    try:
        from trainyard_trainer import data_cli
    except ImportError:
        error("importing datasets needs the trainyard-trainer package (pip install -e libs/trainer)")
        raise typer.Exit(EXIT_CONFIG) from None
    parser = import_parser(data_cli.default_artifact_root())
    args = parser.parse_args(argv)  # --help prints this command's usage and exits 0
    if (args.share or args.no_wait) and not args.publish:
        parser.error("--share and --no-wait go with --publish")
    with api_session(config) as client:
        tenant = client.caller_tenant()
    if tenant is None:
        error("your token names no tenant, so there is no prefix to import into; an operator builds a "
              "platform version with trainyard-data import")
        raise typer.Exit(EXIT_CONFIG)
    args.command, args.tenant = "import", tenant
    code, summary = data_cli.execute(args)
    if summary is None:
        raise typer.Exit(code)
    import json

    typer.echo(json.dumps(summary))
    if args.publish:
        publish_and_follow(config, summary, args.share, wait_s=None if args.no_wait else args.wait_timeout)


def publish_and_follow(config: CliConfig, summary: dict[str, Any], shares: list[str], *,
                       wait_s: float | None) -> None:
    """POST the imported version, then (``wait_s``) follow what the registry makes of this publish."""
    body = {"name": summary["name"], "version": summary["version"], "sha256": summary["sha256"],
            "sharedWith": shares, "tokenizer": summary.get("tokenizer"), "numTokens": summary.get("numTokens")}
    with api_session(config, what="request") as client:
        published = client.publish_dataset(body)
        if wait_s is None:
            stderr().print(f"published {published.dataset}: the registry verifies it before it can be used "
                           f"(trainyard datasets get {published.dataset})")
            return
        stderr().print(f"published {published.dataset}; waiting for the registry to verify it …")
        verdict = await_verdict(client, published.dataset, summary["sha256"], timeout_s=wait_s)
    if verdict is None:
        error(f"the registry has not decided on {published.dataset} within {wait_s:g} s; "
              f"trainyard datasets get {published.dataset} --sha256 {summary['sha256']} shows it")
        raise typer.Exit(EXIT_REFUSED)
    if verdict.state != "verified":
        error(f"the registry refused {published.dataset}: {verdict.reason}")
        for problem in verdict.problems[1:]:
            stderr().print(f"  {problem}")
        raise typer.Exit(EXIT_REFUSED)
    stderr().print(f"{published.dataset} is verified: a job may name it (dataset: {published.dataset})")


def await_verdict(client: ApiClient, ref: str, sha256: str, *, timeout_s: float,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> DatasetView | None:
    """The view of the publish of ``sha256`` once the registry has decided (verified or rejected); None when
    it has not within ``timeout_s``."""
    from trainyard_cli.client import ApiNotFoundError

    deadline, pause = clock() + timeout_s, 0.2
    while True:
        try:
            return client.dataset(ref, sha256=sha256)
        except ApiNotFoundError:  # not decided yet
            if clock() >= deadline:
                return None
        sleep(pause)
        pause = min(2.0, pause * 1.5)


def get_command(config: CliConfig, ref: str, sha256: str | None, as_json: bool) -> None:
    """``trainyard datasets get REF``: the version, and for its owner why publishes of it were refused."""
    with api_session(config, what="request") as client:
        view = client.dataset(ref, sha256=sha256)
    if as_json:
        import json

        typer.echo(json.dumps(view.model_dump(mode="json", by_alias=True), indent=2))
        return
    for line in detail_lines(view):
        typer.echo(line)  # text, never re-wrapped: a sha256 or a path stays whole on its line


def detail_lines(view: DatasetView) -> list[str]:
    """The version as ``key  value`` lines (text, readable at 80 columns), then its refusals."""
    ref = f"{view.tenant}/{view.name}@{view.version}" if view.tenant else f"{view.name}@{view.version}"
    rows = [("dataset", ref), ("state", view.state), ("owner", view.tenant or "platform"),
            ("shared with", ", ".join(view.shared_with) or "-"), ("sha256", view.sha256),
            ("tokenizer", view.tokenizer or "-"),
            ("tokens", f"{view.num_tokens:,}" if view.num_tokens is not None else "-"),
            ("vocabulary", f"{view.vocab_size:,}" if view.vocab_size is not None else "-"),
            ("dtype", view.dtype or "-"), ("manifest", view.manifest_uri),
            ("published" if view.state == "verified" else "rejected",
             view.published_at.isoformat(timespec="seconds") if view.published_at else "-")]
    if view.state != "verified":
        rows.append(("reason", view.reason or "-"))
    lines = [f"{key:<12} {value}" for key, value in rows]
    lines += [f"  {problem}" for problem in (view.problems[1:] if view.state != "verified" else [])]
    for refusal in view.rejections:
        lines += [f"refused      {refusal.rejected_at.isoformat(timespec='seconds')}: a publish with sha256 "
                  f"{refusal.sha256}", f"             {refusal.reason}"]
    return lines
