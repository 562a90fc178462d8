"""trainyard-data import end to end, with worker processes: a user's byte-level BPE of more than
65,536 tokens (trained here with the ``tokenizers`` library), a JSONL corpus (plain and gzip),
read back through the SDK's TokenDataset and DataLoader.

- the ids are stored as uint32 and the windows the loader serves decode to the original documents;
- the version is the same (manifest bytes and sha256) with 1 and 2 workers;
- a bad record found by a worker process is an error naming file and line and leaves no version;
  with skip-bad it is counted, and the result still does not depend on the worker count.

No broker or Redis: "integration" here means real worker processes over real files.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainyard.loader import DataLoader
from trainyard.sampler import GlobalSampler
from trainyard_contract.errors import DataError
from trainyard.data import TokenDataset
from trainyard_trainer.data_import import ImportOptions, import_dataset

from tests.support import corpora

VOCAB = corpora.LARGE_VOCAB
SEQ = 16


@pytest.fixture(scope="module")
def words() -> list[str]:
    return corpora.words()


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory: pytest.TempPathFactory, words: list[str]) -> Path:
    """A byte-level BPE trained to 70,000 tokens on text with ~80,000 distinct words."""
    return corpora.train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", words)


@pytest.fixture(scope="module")
def documents(words: list[str]) -> list[str]:
    return corpora.documents(words)


@pytest.fixture
def corpus(tmp_path: Path, documents: list[str]) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    half = len(documents) // 2
    (d / "part-0.jsonl").write_text("".join(json.dumps({"text": t, "n": i}) + "\n"
                                            for i, t in enumerate(documents[:half])))
    payload = "".join(json.dumps({"text": t}) + "\n" for t in documents[half:]).encode()
    (d / "part-1.jsonl.gz").write_bytes(gzip.compress(payload, mtime=0))
    return d


def run_import(root: Path, corpus: Path, tokenizer: Path, workers: int, **options: object):
    return import_dataset(root, "big", "v1", [str(corpus)], tokenizer=str(tokenizer),
                          options=ImportOptions(shard_tokens=4001, **options), workers=workers)


def test_large_vocabulary_import_reads_back_through_the_loader(tmp_path: Path, corpus: Path, big_tokenizer: Path,
                                                             documents: list[str]) -> None:
    from tokenizers import Tokenizer

    one = run_import(tmp_path / "w1", corpus, big_tokenizer, workers=1)
    two = run_import(tmp_path / "w2", corpus, big_tokenizer, workers=2)
    assert one.manifest_path.read_bytes() == two.manifest_path.read_bytes() and one.sha256 == two.sha256
    for shard in one.manifest.shards:
        mine, theirs = one.manifest_path.parent / shard.file, two.manifest_path.parent / shard.file
        assert mine.read_bytes() == theirs.read_bytes()

    m = two.manifest
    assert m.dtype == "uint32" and m.tokenizer.vocab_size == VOCAB and m.import_info.documents == len(documents)
    assert len(m.shards) > 3

    # Every window, through the loader: one epoch's worth of steps covers every sample id.
    dataset = TokenDataset(two.manifest_path, SEQ)
    sampler = GlobalSampler(len(dataset), seed=3, global_batch=8, micro_batch=4, dp=1, dp_rank=0)
    loader = DataLoader(dataset, sampler, torch.device("cpu"))
    rows: dict[int, np.ndarray] = {}
    while len(rows) < len(dataset):
        ids = [i for micro in sampler.step_sample_ids() for i in micro]
        batches = next(loader)
        stacked = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]).numpy()
        for i, row in zip(ids, stacked, strict=True):
            assert np.array_equal(row, dataset.window(i))
            rows[i] = row
    assert max(int(r.max()) for r in rows.values()) > 65_535  # ids beyond uint16 made it through

    # The windows, in sample order, rebuild each shard up to its last (shorter than a window) tail.
    tokenizer = Tokenizer.from_file(str(two.manifest_path.parent / "tokenizer.json"))
    eos = m.import_info.eos_token_id
    full = np.concatenate([np.fromfile(two.manifest_path.parent / s.file, dtype="<u4") for s in m.shards])
    start = 0
    for index, shard in enumerate(m.shards):
        ids = [i for i in sorted(rows) if dataset.locate(i)[0] == index]
        rebuilt = np.concatenate([*(rows[i][:SEQ] for i in ids), rows[ids[-1]][SEQ:]])
        assert shard.num_tokens - len(rebuilt) < SEQ
        assert np.array_equal(rebuilt, full[start : start + len(rebuilt)])
        start += shard.num_tokens
    # Decoding the whole stored stream gives back the documents, in input order.
    cuts = np.flatnonzero(full == eos)
    decoded = [tokenizer.decode(part[:-1].tolist()) for part in np.split(full, cuts + 1)[:-1]]
    assert decoded == documents


def test_bad_record_in_a_worker_leaves_no_version_and_skip_bad_is_deterministic(
    tmp_path: Path, corpus: Path, big_tokenizer: Path
) -> None:
    lines = (corpus / "part-0.jsonl").read_text().splitlines(keepends=True)
    lines[120] = '{"text": "unterminated\n'
    lines[250] = '{"title": "no text"}\n'
    (corpus / "part-0.jsonl").write_text("".join(lines))

    with pytest.raises(DataError, match=r"part-0\.jsonl:121: not valid JSON"):
        run_import(tmp_path / "w2", corpus, big_tokenizer, workers=2)
    big = tmp_path / "w2" / "datasets" / "big"
    assert not big.exists() or not any(big.iterdir())

    one = run_import(tmp_path / "w1", corpus, big_tokenizer, workers=1, skip_bad=True)
    two = run_import(tmp_path / "w2", corpus, big_tokenizer, workers=2, skip_bad=True)
    assert one.sha256 == two.sha256 and two.manifest.import_info.skipped_records == 2
    assert two.manifest.import_info.documents == 598
