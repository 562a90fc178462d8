"""Dataset import throughput against the tokenizer's own limit (printed ratios, not a test).

A JSONL corpus of real English-and-code text (the tinycorpus stdlib sources cut into documents
of about 2 KB, repeated to ``--megabytes``) and a byte-level BPE (``--tokenizer``, or one of
``--vocab-size`` trained on a sample). For each core count ``n`` (1, 2, 4, … and all cores):

- limit: ``Tokenizer.encode_batch_fast`` (the same ids as ``encode_batch``, without the character
  offsets; what the importer's workers call) over all the documents, already decoded and in memory,
  in a fresh process with ``RAYON_NUM_THREADS=n`` (the tokenizer's own parallelism: what no importer
  can beat on those cores);
- import: ``trainyard-data import --workers n`` of the same corpus into a fresh artifact root
  (reading, decompressing, JSON parsing, encoding, shard writing, sha256 of every file);

and prints tokens/s of both, import ÷ limit (goal ≥ 0.8), and each one's scaling against one
core. Each figure is the median of ``--repeats`` runs.

    python bench/data_import/run.py [--megabytes 32] [--vocab-size 8192] [--tokenizer tokenizer.json]
                                    [--cores 1,2,16] [--repeats 1] [--gzip] [--dir PATH]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOC_CHARS = 2048


def make_corpus(directory: Path, megabytes: float, compress: bool) -> tuple[list[Path], int]:
    from trainyard.data import STDLIB_SOURCES, stdlib_root

    texts = [(stdlib_root() / rel).read_text(encoding="utf-8") for rel in STDLIB_SOURCES]
    docs = [t[i : i + DOC_CHARS] for t in texts for i in range(0, len(t), DOC_CHARS)]
    target = int(megabytes * 1e6)
    directory.mkdir(parents=True)
    files, written, part = [], 0, 0
    while written < target:
        payload = "".join(json.dumps({"text": d, "part": part}) + "\n" for d in docs).encode()
        path = directory / f"part-{part:04d}.jsonl{'.gz' if compress else ''}"
        path.write_bytes(gzip.compress(payload, compresslevel=1, mtime=0) if compress else payload)
        files.append(path)
        written += len(payload)
        part += 1
    return files, written


def train(directory: Path, vocab_size: int) -> Path:
    from trainyard.data import STDLIB_SOURCES, stdlib_root, train_tokenizer

    texts = [(stdlib_root() / rel).read_text(encoding="utf-8") for rel in STDLIB_SOURCES]
    path = directory / "tokenizer.json"
    path.write_text(train_tokenizer(texts, vocab_size))
    return path


def limit_child(corpus: str, tokenizer: str) -> None:
    """In a fresh process (RAYON_NUM_THREADS set by the parent): tokens/s of encode_batch_fast."""
    from tokenizers import Tokenizer

    texts = []
    for path in sorted(Path(corpus).iterdir()):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            texts.extend(json.loads(line)["text"] for line in fh)
    tok = Tokenizer.from_file(tokenizer)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # as the importer encodes
    encode(texts[:64], add_special_tokens=False)  # warm the thread pool
    start = time.perf_counter()
    encodings = encode(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(e.ids) for e in encodings) + len(texts)  # + one EOS per document, as imported
    print(json.dumps({"tokens": tokens, "seconds": seconds}))


def limit(corpus: Path, tokenizer: Path, cores: int) -> float:
    env = {**os.environ, "RAYON_NUM_THREADS": str(cores), "TOKENIZERS_PARALLELISM": "true"}
    out = subprocess.run([sys.executable, __file__, "_limit", str(corpus), str(tokenizer)], env=env,
                         check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["tokens"] / result["seconds"]


def import_rate(corpus: Path, tokenizer: Path, cores: int, scratch: Path) -> tuple[float, str]:
    from trainyard_trainer.data_import import import_dataset

    root = scratch / f"root-{cores}-{time.monotonic_ns()}"
    start = time.perf_counter()
    result = import_dataset(root, "bench", "v1", [str(corpus)], tokenizer=str(tokenizer), workers=cores)
    seconds = time.perf_counter() - start
    shutil.rmtree(root)
    return result.manifest.num_tokens / seconds, result.sha256


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_limit":
        limit_child(sys.argv[2], sys.argv[3])
        return
    all_cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=32.0, help="JSONL bytes of the corpus (uncompressed)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: a BPE trained here)")
    parser.add_argument("--cores", default=None, help="comma-separated core counts (default: 1, 2, 4, … and all)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gzip", action="store_true", help="gzip the corpus files")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    counts = sorted({int(c) for c in args.cores.split(",")} if args.cores else
                    {*(1 << i for i in range(all_cores.bit_length()) if 1 << i <= all_cores), all_cores})

    scratch = Path(tempfile.mkdtemp(prefix="trainyard-bench-import-", dir=args.dir))
    try:
        files, size = make_corpus(scratch / "corpus", args.megabytes, args.gzip)
        tokenizer = args.tokenizer or train(scratch, args.vocab_size)
        print(f"corpus: {len(files)} JSONL files{' (gzip)' if args.gzip else ''}, {size / 1e6:.1f} MB; "
              f"tokenizer {tokenizer}; {all_cores} cores (os.cpu_count)")
        rows, hashes = [], set()
        for n in counts:
            lim = statistics.median(limit(scratch / "corpus", tokenizer, n) for _ in range(args.repeats))
            runs = [import_rate(scratch / "corpus", tokenizer, n, scratch) for _ in range(args.repeats)]
            hashes.update(sha for _, sha in runs)
            rows.append((n, statistics.median(r for r, _ in runs), lim))
        base_imp, base_lim = rows[0][1], rows[0][2]
        print(f"{'cores':>5} {'import tok/s':>13} {'limit tok/s':>12} {'import/limit':>12} "
              f"{'import scaling':>14} {'limit scaling':>13}")
        for n, imp, lim in rows:
            print(f"{n:>5} {imp:>13,.0f} {lim:>12,.0f} {imp / lim:>12.2f} {imp / base_imp:>14.2f} "
                  f"{lim / base_lim:>13.2f}")
        print(f"manifest sha256 identical for every core count: {len(hashes) == 1}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
