"""``trainyard-export``: a READY checkpoint as a Hugging Face model directory, offline.

    trainyard-export --checkpoint <manifest.json or its directory> --out <dir>
                     --model-config <name@version or inline JSON>
                     [--tokenizer tokenizer.json] [--eos-token TOKEN] [--max-shard-size 2GiB] [--json]

The checkpoint is verified against its manifest (every shard's size and sha256) before anything
is written; its model state is then gathered whatever parallel layout wrote it (DDP, FSDP, TP,
PP) and written as config.json, generation_config.json, model.safetensors (sharded with an index
past --max-shard-size), tokenizer.json + tokenizer_config.json and a listing of every file
(trainyard-export.json). --out appears whole or not at all, and must not exist yet.

Load the result with transformers:

    AutoModelForCausalLM.from_pretrained(DIR); AutoTokenizer.from_pretrained(DIR)

Exit codes: 0 written; 2 (config) a model config, tokenizer or --out that cannot work;
4 (checkpoint) a checkpoint that is not READY or fails verification; 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from pydantic import ValidationError
from trainyard_contract.catalog import ModelConfig, resolve_model
from trainyard_contract.errors import CheckpointError, ConfigError, TrainyardError
from trainyard_contract.exitcodes import CHECKPOINT, CONFIG, ERROR, OK

from trainyard_trainer.hf import (
    DEFAULT_MAX_SHARD_BYTES,
    checkpoint_model_state,
    write_hf_model,
)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """``2GiB``, ``500MB``, ``1048576`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write bytes or e.g. 500MB, 2GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError("the shard size must be positive")
    return size


def parse_model_config(text: str) -> ModelConfig:
    """A catalog reference (``gpt-tiny@v1``) or an inline JSON object (the spec's modelConfig)."""
    if text.lstrip().startswith("{"):
        try:
            return ModelConfig.model_validate_json(text)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "modelConfig"
            raise ConfigError(f"--model-config {where}: {first['msg']}") from None
    try:
        return resolve_model(text)
    except KeyError as exc:
        raise ConfigError(f"--model-config: {exc.args[0]}; or pass the job's inline modelConfig as JSON") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainyard-export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="the checkpoint's manifest.json, its directory, or a file:// URI of the manifest")
    parser.add_argument("--out", required=True, type=Path, help="the directory to create (must not exist)")
    parser.add_argument("--model-config", required=True,
                        help="the job's model: a catalog reference (llama-tiny@v1) or its inline modelConfig JSON")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="the dataset's tokenizer.json, copied beside the weights (omit: no tokenizer files)")
    parser.add_argument("--eos-token", default=None,
                        help="the dataset's end-of-document token (its manifest's separator, e.g. <|endoftext|>); "
                             "declared as eos/bos when the tokenizer has it")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="split model.safetensors into shards of at most this size, with an index "
                             "(default: 2GiB)")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON line {"uri", "sha256", "files"} on stdout when done')
    return parser


def _progress(message: str) -> None:
    print(f"trainyard-export: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = parse_model_config(args.model_config)
        if args.out.exists():
            raise ConfigError(f"--out {args.out} already exists; an export is written once: choose another "
                              "directory or remove it")
        if args.tokenizer is not None and not args.tokenizer.is_file():
            raise ConfigError(f"--tokenizer {args.tokenizer} does not exist (the dataset's tokenizer.json)")
        _progress(f"verifying checkpoint {args.checkpoint}")
        manifest, state = checkpoint_model_state(args.checkpoint)
        _progress(f"gathered step {manifest.global_step} of job {manifest.job_id}: {len(state)} tensors, "
                  f"{sum(t.numel() for t in state.values()):,} parameters")
        listing = write_hf_model(args.out, config, state, tokenizer_json=args.tokenizer,
                                 eos_token=args.eos_token, max_shard_bytes=args.max_shard_size,
                                 progress=_progress)
    except CheckpointError as exc:
        print(f"trainyard-export: refused: {exc}", file=sys.stderr)
        return CHECKPOINT
    except ConfigError as exc:
        print(f"trainyard-export: {exc}", file=sys.stderr)
        return CONFIG
    except TrainyardError as exc:
        print(f"trainyard-export: {exc}", file=sys.stderr)
        return ERROR
    _progress(f"wrote {listing.directory} ({len(listing.files)} files, sha256 {listing.sha256})")
    if args.json:
        print(json.dumps(listing.wire()), flush=True)
    return OK


if __name__ == "__main__":
    sys.exit(main())
