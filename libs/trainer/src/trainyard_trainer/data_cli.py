"""``trainyard-data``: build and check versioned token datasets.

    trainyard-data prepare --name tinycorpus --version v1 [--artifact-root PATH|s3://bucket/prefix]
    trainyard-data verify  --name tinycorpus --version v1 [--artifact-root PATH|s3://bucket/prefix]
    trainyard-data import  --name NAME --version V [--tenant T] [--tokenizer tokenizer.json] INPUT...

``prepare`` builds the tinycorpus example; ``import`` builds a version from your own files
(.txt, .jsonl, .parquet; .gz/.zst; directories, globs, fsspec URLs) with your tokenizer.json
or one trained on them (see trainyard_trainer.data_import). Both are idempotent: an existing
version that verifies (and, for import, was built from the same inputs) is left alone. Each
command prints one JSON object (manifestUri, sha256, tokenizer, numTokens) on stdout, the
fields a DatasetVersionPublished event needs.

This is the operator's and the offline tool (``--tenant`` names the owner; without it, a platform version).
A user's ``trainyard datasets import`` runs the same import as the token's tenant (trainyard_cli.datasets),
through :func:`add_version_arguments`, :func:`add_import_arguments` and :func:`execute`.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from trainyard_contract.errors import TrainyardError
from trainyard_contract.events import dataset_key
from trainyard_contract.exitcodes import DATA, ERROR, OK
from trainyard_contract.settings import ServiceSettings, load_settings
from trainyard_contract.storage import (
    ArtifactLayout,
    Location,
    ObjectPath,
    as_location,
    is_file,
    location_uri,
    sha256_of,
)

from trainyard.data import (
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VOCAB_SIZE,
    MANIFEST_FILE,
    DatasetManifest,
    existing_dataset,
    load_dataset_manifest,
    prepare_dataset,
    upload_dataset,
    verify_dataset,
)


def _parser(default_root: Location) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainyard-data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="TRAINYARD_ARTIFACT_ROOT sets the default artifact root (now: %s)." % default_root,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command, help_text in (("prepare", "build the tinycorpus example version (idempotent)"),
                               ("verify", "check a dataset version's files against its manifest"),
                               ("import", "build a dataset version from your files and tokenizer")):
        p = sub.add_parser(command, help=help_text)
        add_version_arguments(p, default_root, required=command == "import")
        if command != "prepare":
            p.add_argument("--tenant", type=_tenant, default=None,
                           help="the owning tenant: its files go under tenants/<tenant>/datasets/ "
                                "(default: the platform's, under datasets/)")
        if command == "prepare":
            p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
            p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
        if command == "import":
            add_import_arguments(p)
    return parser


def add_version_arguments(p: argparse.ArgumentParser, default_root: Location, *, required: bool) -> None:
    """``--name``, ``--version`` (``required``, else tinycorpus@v1) and ``--artifact-root``."""
    if required:
        p.add_argument("--name", required=True, help="the dataset's name (letters, digits, . _ -): wiki-en")
        p.add_argument("--version", required=True,
                       help="its version; a version is immutable, new data is a new version: 2026-12-01")
    else:
        p.add_argument("--name", default="tinycorpus", help="the dataset's name (default: tinycorpus)")
        p.add_argument("--version", default="v1", help="its version (default: v1)")
    p.add_argument("--artifact-root", type=as_location, default=default_root,
                   help=f"the artifact store's root: a directory or an s3://bucket/prefix URL (default: "
                        f"{default_root}; TRAINYARD_ARTIFACT_ROOT sets it)")


def default_artifact_root() -> Location:
    """TRAINYARD_ARTIFACT_ROOT, or the default (the settings, parsed here, at the command line's edge)."""
    return load_settings(ServiceSettings).artifact_root_abs


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    from trainyard_trainer.data_import import DEFAULT_IMPORT_SHARD_TOKENS

    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, directories or globs (quote them) of .txt/.jsonl/.parquet, optionally .gz/.zst; "
                        "local paths or fsspec URLs")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json; without it a byte-level BPE of "
                                       "--vocab-size is trained on the inputs")
    p.add_argument("--eos-token", help="the end-of-document token (default: the tokenizer's own, e.g. <|endoftext|>)")
    p.add_argument("--text-field", default="text", help="the JSONL field holding the text (default: text)")
    p.add_argument("--column", default="text", help="the Parquet column holding the text (default: text)")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip malformed records (counted in the manifest) instead of failing")
    p.add_argument("--workers", type=_positive, default=None, help="processes (default: all cores)")
    p.add_argument("--vocab-size", type=_positive, default=DEFAULT_VOCAB_SIZE,
                   help="vocabulary of the tokenizer trained when --tokenizer is not given")
    p.add_argument("--shard-tokens", type=_positive, default=DEFAULT_IMPORT_SHARD_TOKENS,
                   help=f"tokens per shard file (default: {DEFAULT_IMPORT_SHARD_TOKENS:,})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _tenant(text: str) -> str:
    if not re.match(r"^[a-z0-9][a-z0-9._-]{0,62}$", text):
        raise argparse.ArgumentTypeError(f"not a tenant name (lower-case letters, digits, . _ -): {text!r}")
    return text


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def run_prepare(args: argparse.Namespace) -> tuple[Location, str, DatasetManifest]:
    """The tinycorpus version: built in place under a directory root; under an object-store root built in a
    temporary directory, then uploaded (each object checked as it streams, the manifest last)."""
    build = dict(vocab_size=args.vocab_size, shard_tokens=args.shard_tokens)
    if not isinstance(args.artifact_root, ObjectPath):
        return prepare_dataset(args.artifact_root, args.name, args.version, **build)
    destination = ArtifactLayout(args.artifact_root).dataset_dir(args.name, args.version)
    if is_file(destination / MANIFEST_FILE):
        return existing_dataset(destination)  # idempotent, as on a directory: verified, not rebuilt
    with tempfile.TemporaryDirectory(prefix="trainyard-data-") as scratch:
        local, _, manifest = prepare_dataset(Path(scratch), args.name, args.version, **build)
        target = upload_dataset(local.parent, destination)  # type: ignore[arg-type]  # an object-store root here
    return target, sha256_of(target), manifest


def run_import(args: argparse.Namespace) -> tuple[Location, str, DatasetManifest]:
    from trainyard_trainer.data_import import ImportOptions, import_dataset

    options = ImportOptions(text_field=args.text_field, column=args.column, skip_bad=args.skip_bad,
                            eos_token=args.eos_token, vocab_size=args.vocab_size, shard_tokens=args.shard_tokens)
    result = import_dataset(args.artifact_root, args.name, args.version, args.inputs, tokenizer=args.tokenizer,
                            options=options, workers=args.workers, progress=not args.no_progress,
                            tenant=args.tenant)
    return result.manifest_path, result.sha256, result.manifest


def _summary(manifest_path: Location, sha256: str, manifest: DatasetManifest) -> dict[str, Any]:
    return {
        "name": manifest.name,
        "version": manifest.version,
        "manifestUri": location_uri(manifest_path),
        "sha256": sha256,
        "tokenizer": manifest.tokenizer.version,
        "numTokens": manifest.num_tokens,
        "shards": len(manifest.shards),
        "dtype": manifest.dtype,
        **({"documents": manifest.import_info.documents, "skippedRecords": manifest.import_info.skipped_records}
           if manifest.import_info is not None else {}),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser(default_artifact_root()).parse_args(argv)
    code, summary = execute(args)
    if summary is not None:
        print(json.dumps(summary))
    return code


def execute(args: argparse.Namespace) -> tuple[int, dict[str, Any] | None]:
    """Run a parsed command (``args.command``: prepare, import, verify; ``args.tenant`` the owner, None: the
    platform's): its exit status, and on success the summary it prints. Errors are one line on stderr."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    try:
        if args.command == "prepare":
            path, sha, manifest = run_prepare(args)
        elif args.command == "import":
            path, sha, manifest = run_import(args)
        else:
            path = ArtifactLayout(args.artifact_root).dataset_dir(args.name, args.version, args.tenant) / MANIFEST_FILE
            if not is_file(path):
                print(f"error: no dataset version {dataset_key(args.tenant, args.name, args.version)} at "
                      f"{location_uri(path.parent)} (no {MANIFEST_FILE}); build it with `trainyard-data prepare` "
                      "or `trainyard-data import`", file=sys.stderr)
                return DATA, None
            manifest = load_dataset_manifest(path)
            if problems := verify_dataset(path.parent, manifest):
                ref = dataset_key(args.tenant, args.name, args.version)
                print(f"error: {ref} does not verify: {'; '.join(problems)}", file=sys.stderr)
                return DATA, None
            sha = sha256_of(path)
    except TrainyardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return DATA, None
    except OSError as exc:  # the artifact root: full, read-only, gone
        print(f"error: cannot write under {args.artifact_root}: {exc}", file=sys.stderr)
        return ERROR, None
    except KeyboardInterrupt:
        print("interrupted: nothing was published (the half-built version was removed)", file=sys.stderr)
        return ERROR, None
    return OK, _summary(path, sha, manifest)


if __name__ == "__main__":
    sys.exit(main())
