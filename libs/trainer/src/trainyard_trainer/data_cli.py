"""``trainyard-data``: build and check versioned token datasets.

    trainyard-data prepare --name tinycorpus --version v1 [--artifact-root PATH]
    trainyard-data verify  --name tinycorpus --version v1 [--artifact-root PATH]

``prepare`` is idempotent: an existing version that verifies is left alone. Both print one
JSON object (manifestUri, sha256, tokenizer, numTokens) on stdout, the fields a
DatasetVersionPublished event needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from trainyard_common.errors import TrainyardError
from trainyard_common.exitcodes import DATA, OK
from trainyard_common.settings import ServiceSettings, load_settings
from trainyard_common.storage import ArtifactLayout, path_to_uri, sha256_file

from trainyard_trainer.data import (
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VOCAB_SIZE,
    MANIFEST_FILE,
    DatasetManifest,
    load_dataset_manifest,
    prepare_dataset,
    verify_dataset,
)


def _parser(default_root: Path) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainyard-data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="TRAINYARD_ARTIFACT_ROOT sets the default artifact root (now: %s)." % default_root,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command, help_text in (("prepare", "build a dataset version (idempotent)"),
                               ("verify", "check a dataset version's files against its manifest")):
        p = sub.add_parser(command, help=help_text)
        p.add_argument("--name", default="tinycorpus")
        p.add_argument("--version", default="v1")
        p.add_argument("--artifact-root", type=Path, default=default_root)
        if command == "prepare":
            p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
            p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    return parser


def _summary(manifest_path: Path, sha256: str, manifest: DatasetManifest) -> str:
    return json.dumps({
        "name": manifest.name,
        "version": manifest.version,
        "manifestUri": path_to_uri(manifest_path),
        "sha256": sha256,
        "tokenizer": manifest.tokenizer.version,
        "numTokens": manifest.num_tokens,
        "shards": len(manifest.shards),
    })


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
    settings = load_settings(ServiceSettings)
    args = _parser(settings.artifact_root_abs).parse_args(argv)
    try:
        if args.command == "prepare":
            path, sha, manifest = prepare_dataset(
                args.artifact_root, args.name, args.version,
                vocab_size=args.vocab_size, shard_tokens=args.shard_tokens,
            )
        else:
            path = ArtifactLayout(args.artifact_root).dataset_dir(args.name, args.version) / MANIFEST_FILE
            manifest = load_dataset_manifest(path)
            if problems := verify_dataset(path.parent, manifest):
                print(f"error: {args.name}@{args.version} does not verify: {'; '.join(problems)}", file=sys.stderr)
                return DATA
            sha = sha256_file(path)
    except TrainyardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return DATA
    print(_summary(path, sha, manifest))
    return OK


if __name__ == "__main__":
    sys.exit(main())
