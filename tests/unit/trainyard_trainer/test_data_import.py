"""trainyard-data import: pure parts table-tested, the pipeline run in-process (one worker) on small corpora.

Worker counts above one (spawned processes) and a >65,536-token BPE are in
tests/integration/test_data_import.py.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from trainyard_contract import exitcodes
from trainyard_contract.errors import DataError
from trainyard_trainer import data_import
from trainyard.data import (
    DatasetManifest,
    TokenDataset,
    load_dataset_manifest,
    token_dtype_for,
    train_tokenizer,
)
from trainyard_trainer.data_cli import main
from trainyard_trainer.data_import import (
    ImportOptions,
    Task,
    choose_eos,
    classify,
    documents_with_reserved_ids,
    expand_inputs,
    import_dataset,
    join_documents,
    parse_records,
    reserved_ids,
)

FIXTURES = Path(__file__).parent / "fixtures"
DOCS = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(i % 13 + 1)) for i in range(60)]


def jsonl(lines: list[object]) -> bytes:
    return b"".join((json.dumps(x) if not isinstance(x, bytes) else x.decode()).encode() + b"\n" for x in lines)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_bytes(jsonl([{"text": t, "id": i} for i, t in enumerate(DOCS[:20])]))
    (d / "sub" / "b.jsonl.gz").write_bytes(gzip.compress(jsonl([{"text": t} for t in DOCS[20:40]])))
    (d / "c.txt").write_text(DOCS[40])
    (d / "notes.md").write_text("not an input format: ignored in a directory")
    (d / ".hidden.jsonl").write_text("not json: hidden files are skipped")
    return d


@pytest.fixture
def tokenizer_file(tmp_path: Path) -> Path:
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(train_tokenizer(DOCS, 300))
    return path


def build(root: Path, inputs: list[str], tokenizer: Path | None = None, **options: object):
    return import_dataset(root, "mine", "v1", inputs, tokenizer=str(tokenizer) if tokenizer else None,
                          options=ImportOptions(shard_tokens=97, **options), workers=1)


def decoded_documents(manifest_path: Path) -> list[str]:
    """Every shard read back through TokenDataset (windows of 2 tokens cover each shard), split at EOS."""
    from tokenizers import Tokenizer

    ds = TokenDataset(manifest_path, 1)
    windows = ds.windows(range(len(ds)))
    shard_of = [ds.locate(s)[0] for s in range(len(ds))]
    last_in_shard = [s == len(ds) - 1 or shard_of[s + 1] != shard_of[s] for s in range(len(ds))]
    stream = np.concatenate([w if last else w[:1] for w, last in zip(windows, last_in_shard)])
    assert len(stream) == ds.manifest.num_tokens  # one-token stride: nothing left out
    tokenizer = Tokenizer.from_file(str(manifest_path.parent / "tokenizer.json"))
    eos = ds.manifest.import_info.eos_token_id
    cuts = np.flatnonzero(stream == eos)
    assert cuts[-1] == len(stream) - 1  # every document ends with EOS
    return [tokenizer.decode(part.tolist()) for part in np.split(stream, cuts + 1)[:-1] for part in [part[:-1]]]


# ----------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize("name, expected", [
    ("a.txt", ("txt", None)), ("a.jsonl", ("jsonl", None)), ("A.JSONL.GZ", ("jsonl", "gzip")),
    ("a.ndjson.zst", ("jsonl", "zstd")), ("a.txt.zstd", ("txt", "zstd")), ("a.parquet", ("parquet", None)),
    ("a.parquet.gz", None), ("a.json", None), ("a.md", None), ("a.gz", None),
])
def test_classify(name: str, expected: object) -> None:
    assert classify(name) == expected


def test_choose_eos() -> None:
    vocab = {"a": 0, "<|endoftext|>": 5, "</s>": 6, "<pad>": 7}
    assert choose_eos(vocab, ["<pad>", "</s>", "<|endoftext|>"], None) == ("<|endoftext|>", 5)
    assert choose_eos(vocab, ["</s>", "<pad>"], None) == ("</s>", 6)
    assert choose_eos(vocab, ["<pad>"], "a") == ("a", 0)
    with pytest.raises(DataError, match="--eos-token 'zz' is not a token"):
        choose_eos(vocab, ["</s>"], "zz")
    with pytest.raises(DataError, match=r"no end-of-document token among its special tokens \(<pad>\).*--eos-token"):
        choose_eos(vocab, ["<pad>"], None)


def test_token_dtype_fits_the_vocabulary() -> None:
    assert token_dtype_for(1024) == token_dtype_for(65_536) == "uint16"
    assert token_dtype_for(65_537) == token_dtype_for(128_256) == "uint32"
    with pytest.raises(DataError):
        token_dtype_for(0)


def test_join_documents_ends_each_with_eos() -> None:
    out = join_documents([[1, 2], [], [70_000]], eos_id=9)
    assert out.dtype == np.uint32 and out.tolist() == [1, 2, 9, 9, 70_000, 9]


JSONL_TASK = Task("jsonl", "in/x.jsonl", 10, [
    b'{"text": "one"}\n', b"\n", b'{"text": oops}\n', b'{"body": "x", "id": 1}\n', b'{"text": 3}\n',
    b"[1, 2]\n", b'{"text": "\xff"}\n', b'{"text": "two"}\n',
], "text")


def test_parse_records_names_file_and_line_of_the_first_bad_record() -> None:
    parsed = parse_records(JSONL_TASK, skip_bad=False)
    assert parsed.error == "in/x.jsonl:12: not valid JSON (Expecting value)" and parsed.texts == ["one"]
    rest = Task("jsonl", "in/x.jsonl", 13, JSONL_TASK.items[3:], "text")
    assert parse_records(rest, False).error == ("in/x.jsonl:13: no field 'text' (its fields: body, id); "
                                                "choose one with --text-field")
    rest = Task("jsonl", "in/x.jsonl", 14, JSONL_TASK.items[4:], "text")
    assert parse_records(rest, False).error == "in/x.jsonl:14: field 'text' is a number, not a string"
    rest = Task("jsonl", "in/x.jsonl", 15, JSONL_TASK.items[5:], "text")
    assert "in/x.jsonl:15: a JSON list, not an object" in parse_records(rest, False).error
    rest = Task("jsonl", "in/x.jsonl", 16, JSONL_TASK.items[6:], "text")
    assert parse_records(rest, False).error.startswith("in/x.jsonl:16: not valid UTF-8")


def test_parse_records_skip_bad_counts_and_keeps_the_good() -> None:
    parsed = parse_records(JSONL_TASK, skip_bad=True)
    # the blank line is no record
    assert parsed.error is None and parsed.texts == ["one", "two"] and parsed.skipped == 5


def test_parse_records_parquet_and_txt() -> None:
    assert parse_records(Task("parquet", "p.parquet", 1, ["a", None, "b"], "text"), False).error == (
        "p.parquet: row 2: column 'text' is null, not a string")
    assert parse_records(Task("parquet", "p.parquet", 1, ["a", None, "b"], "text"), True).texts == ["a", "b"]
    assert parse_records(Task("txt", "t.txt", 1, ["é".encode()]), False).texts == ["é"]
    assert parse_records(Task("txt", "t.txt", 1, [b"ok\xff"]), False).error == "t.txt: not valid UTF-8 at byte 2"


def test_existing_manifest_re_serialises_to_the_same_bytes() -> None:
    """tinycorpus@v1 as published before uint32 and importInfo existed keeps its bytes and sha256."""
    path = FIXTURES / "tinycorpus-v1-manifest.json"
    raw = path.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == "f214c0a348ee8bda01c0f84f81dcc8b3ec1b70c23398f8ab8bacab39aa8882c8"
    manifest = load_dataset_manifest(path)
    assert manifest.dtype == "uint16" and manifest.import_info is None and manifest.created_at is not None
    assert manifest.to_bytes() == raw
    assert DatasetManifest.model_validate_json(manifest.to_bytes()).to_bytes() == raw


# ----------------------------------------------------------------------------- inputs


def test_expand_inputs_orders_files_and_records_paths_below_their_input(corpus: Path) -> None:
    files = expand_inputs([str(corpus), str(corpus / "a.jsonl"), str(corpus / "sub" / "*.gz")])
    assert [(f.relative, f.format, f.compression) for f in files] == [
        ("a.jsonl", "jsonl", None), ("c.txt", "txt", None), ("sub/b.jsonl.gz", "jsonl", "gzip"),
    ]  # a.jsonl and b.jsonl.gz named twice: read once
    assert [f.relative for f in expand_inputs([f"{corpus}/**/*.jsonl*"])] == ["a.jsonl", "sub/b.jsonl.gz"]


@pytest.mark.parametrize("make, match", [
    (lambda d: str(d / "missing"), "not found"),
    (lambda d: str(d / "notes.md"), r"not a \.txt, \.jsonl or \.parquet file"),
    (lambda d: str(d / "*.csv"), "the glob matches no file"),
])
def test_expand_inputs_refuses_what_it_cannot_read(corpus: Path, make, match: str) -> None:
    with pytest.raises(DataError, match=match):
        expand_inputs([make(corpus)])


# ----------------------------------------------------------------------------- the pipeline (one worker)


def test_import_round_trips_documents_through_the_token_dataset(tmp_path: Path, corpus: Path,
                                                               tokenizer_file: Path) -> None:
    result = build(tmp_path / "root", [str(corpus)], tokenizer_file)
    m = result.manifest
    assert result.created and m.dtype == "uint16" and m.separator == "<|endoftext|>"
    assert m.tokenizer.sha256 == hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    assert m.tokenizer.version == f"bpe{m.tokenizer.vocab_size}-{m.tokenizer.sha256[:12]}"
    assert m.tokenizer.kind == "hf-bpe" and m.import_info.tokenizer_source == "user"
    assert m.import_info.documents == 41 and m.import_info.skipped_records == 0 and m.created_at is None
    assert [s.path for s in m.sources] == ["a.jsonl", "c.txt", "sub/b.jsonl.gz"]
    assert m.sources[2].sha256 == hashlib.sha256((corpus / "sub" / "b.jsonl.gz").read_bytes()).hexdigest()
    assert len(m.shards) > 2 and all(s.num_tokens == 97 for s in m.shards[:-1])
    assert decoded_documents(result.manifest_path) == DOCS[:20] + [DOCS[40]] + DOCS[20:40]
    assert (result.manifest_path.parent / "tokenizer.json").read_bytes() == tokenizer_file.read_bytes()
    assert not [p for p in result.manifest_path.parent.parent.iterdir() if p.name.startswith(".")]


def test_import_is_idempotent_and_relocatable(tmp_path: Path, corpus: Path, tokenizer_file: Path) -> None:
    first = build(tmp_path / "root", [str(corpus)], tokenizer_file)
    again = build(tmp_path / "root", [str(corpus)], tokenizer_file)
    assert not again.created and again.sha256 == first.sha256
    moved = corpus.rename(tmp_path / "elsewhere")  # the same files under another path: the same version
    assert build(tmp_path / "root2", [str(moved)], tokenizer_file).sha256 == first.sha256
    (moved / "c.txt").write_text("changed")
    with pytest.raises(DataError, match="already exists, built from other inputs.*new --version"):
        build(tmp_path / "root", [str(moved)], tokenizer_file)


def test_import_trains_a_tokenizer_when_none_is_given(tmp_path: Path, corpus: Path) -> None:
    result = build(tmp_path / "root", [str(corpus)], vocab_size=300)
    m = result.manifest
    assert m.tokenizer.kind == "byte-level-bpe" and m.import_info.tokenizer_source == "trained"
    assert m.tokenizer.vocab_size <= 300
    assert decoded_documents(result.manifest_path) == DOCS[:20] + [DOCS[40]] + DOCS[20:40]
    assert build(tmp_path / "again", [str(corpus)], vocab_size=300).sha256 == result.sha256


def test_parquet_column(tmp_path: Path, tokenizer_file: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": DOCS[:30], "n": list(range(30))}), tmp_path / "p.parquet")
    result = build(tmp_path / "root", [str(tmp_path / "p.parquet")], tokenizer_file, column="body")
    assert decoded_documents(result.manifest_path) == DOCS[:30]
    with pytest.raises(DataError,
                       match=r"p\.parquet: no column 'text' \(its columns: body, n\); choose one with --column"):
        import_dataset(tmp_path / "root", "p", "v2", [str(tmp_path / "p.parquet")], tokenizer=str(tokenizer_file),
                       workers=1)


def test_zstd_input(tmp_path: Path, tokenizer_file: Path) -> None:
    import zstandard
    path = tmp_path / "z.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(jsonl([{"text": t} for t in DOCS[:10]])))
    assert decoded_documents(build(tmp_path / "root", [str(path)], tokenizer_file).manifest_path) == DOCS[:10]


def test_fsspec_url_input(tmp_path: Path, tokenizer_file: Path) -> None:
    import fsspec
    fs = fsspec.filesystem("memory")
    fs.pipe("/trainyard-test/corpus/x.jsonl", jsonl([{"text": t} for t in DOCS[:12]]))
    try:
        result = build(tmp_path / "root", ["memory://trainyard-test/corpus"], tokenizer_file)
    finally:
        fs.rm("/trainyard-test", recursive=True)
    assert [s.path for s in result.manifest.sources] == ["x.jsonl"]
    assert decoded_documents(result.manifest_path) == DOCS[:12]


def version_traces(root: Path) -> list[Path]:
    """What a failed import of mine@v1 left under the artifact root: nothing, not even an empty ``mine/``
    (the root itself and ``datasets/`` may stay: they existed, or are the store's own)."""
    d = root / "datasets"
    return sorted(d.rglob("*")) if d.exists() else []


def test_bad_record_is_an_error_naming_file_and_line_and_leaves_no_version(tmp_path: Path, corpus: Path,
                                                                          tokenizer_file: Path) -> None:
    bad = corpus / "z.jsonl"  # read last, after shards of the good files were written
    bad.write_bytes(jsonl([{"text": "fine"}, b'{"text": "cut', {"text": "fine"}, {"body": "x"}]))
    with pytest.raises(DataError, match=r"z\.jsonl:2: not valid JSON .*--skip-bad"):
        build(tmp_path / "root", [str(corpus)], tokenizer_file)
    assert version_traces(tmp_path / "root") == []

    result = build(tmp_path / "root", [str(corpus)], tokenizer_file, skip_bad=True)
    assert result.manifest.import_info.skipped_records == 2 and result.manifest.import_info.skip_bad
    assert result.manifest.import_info.documents == 43
    assert decoded_documents(result.manifest_path)[-2:] == ["fine", "fine"]


def test_unreadable_file_is_an_error_even_with_skip_bad(tmp_path: Path, corpus: Path, tokenizer_file: Path) -> None:
    (corpus / "z.jsonl.gz").write_bytes(gzip.compress(jsonl([{"text": "x"}]))[:-12] + b"garbage!")
    with pytest.raises(DataError, match=r"z\.jsonl\.gz: cannot read"):
        build(tmp_path / "root", [str(corpus)], tokenizer_file, skip_bad=True)
    assert version_traces(tmp_path / "root") == []


def test_a_failure_while_publishing_leaves_no_version(tmp_path: Path, corpus: Path, tokenizer_file: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = data_import.atomic_write_bytes

    def failing(path: Path, data: bytes) -> None:
        if Path(path).name == "manifest.json":
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(data_import, "atomic_write_bytes", failing)
    with pytest.raises(OSError):
        build(tmp_path / "root", [str(corpus)], tokenizer_file)
    assert version_traces(tmp_path / "root") == []
    monkeypatch.setattr(data_import, "atomic_write_bytes", real)
    assert build(tmp_path / "root", [str(corpus)], tokenizer_file).created


def test_tokenizer_without_an_end_of_document_token(tmp_path: Path, corpus: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(sorted({w for d in DOCS for w in d.split()} | {"[UNK]", "<sep>"}))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["[UNK]"])
    path = tmp_path / "wl.json"
    tok.save(str(path))
    with pytest.raises(DataError, match=r"no end-of-document token.*\(\[UNK\]\).*--eos-token"):
        build(tmp_path / "root", [str(corpus)], path)
    result = build(tmp_path / "root", [str(corpus)], path, eos_token="<sep>")
    assert result.manifest.separator == "<sep>" and result.manifest.tokenizer.kind == "hf-wordlevel"


def test_vocabulary_over_65536_is_stored_as_uint32(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*words, "[UNK]"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    docs = [" ".join(words[(i * 9973 + j * 7919) % 70_000] for j in range(20)) for i in range(30)]
    (tmp_path / "d.jsonl").write_bytes(jsonl([{"text": t} for t in docs]))
    result = build(tmp_path / "root", [str(tmp_path / "d.jsonl")], tmp_path / "tokenizer.json")
    m = result.manifest
    assert m.dtype == "uint32" and m.tokenizer.vocab_size == 70_002 and m.separator == "</s>"
    assert all(s.size_bytes == 4 * s.num_tokens for s in m.shards)
    ds = TokenDataset(result.manifest_path, 8)
    assert ds.windows(range(len(ds))).max() > 65_535
    assert decoded_documents(result.manifest_path) == docs


# ----------------------------------------------------------------------------- the CLI


def test_cli_import_prints_the_summary_and_errors_without_traceback(
    tmp_path: Path, corpus: Path, tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "artifacts"
    args = ["import", "--name", "mine", "--version", "v1", "--artifact-root", str(root), "--workers", "1",
            "--tokenizer", str(tokenizer_file), "--no-progress"]
    assert main([*args, str(corpus)]) == exitcodes.OK
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "uint16" and out["documents"] == 41 and out["skippedRecords"] == 0
    assert out["sha256"] == hashlib.sha256((root / "datasets/mine/v1/manifest.json").read_bytes()).hexdigest()

    (corpus / "z.jsonl").write_text('{"text": "x"}\n{"txt": "y"}\n')
    assert main([*args[:4], "v2", *args[5:], str(corpus)]) == exitcodes.DATA
    err = capsys.readouterr().err
    assert "z.jsonl:2: no field 'text'" in err and "Traceback" not in err
    assert not (root / "datasets" / "mine" / "v2").exists()
    assert sorted(p.name for p in (root / "datasets" / "mine").iterdir()) == ["v1"]  # v1 stands, nothing else


def test_a_failed_import_leaves_no_empty_directories(tmp_path: Path, tokenizer_file: Path) -> None:
    """Not the dataset's ``<name>/``, nor a tenant's prefix made for it; what existed before stays."""
    root = tmp_path / "artifacts"
    (root / "datasets" / "other" / "v1").mkdir(parents=True)
    (tmp_path / "bad.jsonl").write_text('{"txt": "y"}\n')
    for tenant in (None, "acme"):
        with pytest.raises(DataError, match="no field 'text'"):
            import_dataset(root, "fresh", "v1", [str(tmp_path / "bad.jsonl")], tokenizer=str(tokenizer_file),
                           workers=1, tenant=tenant)
    assert sorted(root.rglob("*")) == [root / "datasets", root / "datasets" / "other", root / "datasets/other/v1"]


def test_truncated_zstd_is_an_error_not_a_short_file(tmp_path: Path, tokenizer_file: Path) -> None:
    import zstandard
    frame = zstandard.ZstdCompressor().compress(jsonl([{"text": t} for t in DOCS]))
    two_frames = tmp_path / "ok" / "two.jsonl.zst"
    two_frames.parent.mkdir()
    two_frames.write_bytes(frame + frame)  # concatenated frames are one valid stream
    assert decoded_documents(build(tmp_path / "root", [str(two_frames)], tokenizer_file).manifest_path) == DOCS * 2
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(frame[: len(frame) // 2])
    with pytest.raises(DataError, match=r"cut\.jsonl\.zst: cannot read \(zstd stream ends inside a frame"):
        build(tmp_path / "root2", [str(cut)], tokenizer_file, skip_bad=True)


def test_worker_processes_give_the_same_version(tmp_path: Path, corpus: Path, tokenizer_file: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked workers (cheap: no re-import); chunks small enough that every worker gets several."""
    monkeypatch.setattr(data_import, "CHUNK_BYTES", 4096)
    (corpus / "many.jsonl").write_bytes(jsonl([{"text": t * 40} for t in DOCS]))
    options = ImportOptions(shard_tokens=997)
    results = [import_dataset(tmp_path / f"w{n}", "mine", "v1", [str(corpus)], tokenizer=str(tokenizer_file),
                              options=options, workers=n) for n in (1, 2, 3)]
    assert len({r.manifest_path.read_bytes() for r in results}) == 1
    assert decoded_documents(results[2].manifest_path)[:20] == DOCS[:20]


def test_a_bad_record_found_by_a_worker_process(tmp_path: Path, corpus: Path, tokenizer_file: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_import, "CHUNK_BYTES", 64)  # many tasks: the bad one is in flight with others
    (corpus / "z.jsonl").write_bytes(jsonl([{"text": t} for t in DOCS[:30]] + [{"txt": "no"}] + [{"text": "x"}] * 30))
    with pytest.raises(DataError, match=r"z\.jsonl:31: no field 'text'"):
        import_dataset(tmp_path / "root", "mine", "v1", [str(corpus)], tokenizer=str(tokenizer_file), workers=2)
    assert version_traces(tmp_path / "root") == []


# ----------------------------------------------------------------------------- special-token text in documents

# The special tokens of the common families (GPT-2, Llama 3 and its chat template, Llama 2 / Mistral / T5, BERT,
# Gemma), added to the test BPE beside its own <|endoftext|>.
FAMILY_SPECIALS = ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|reserved_special_token_0|>", "<s>", "</s>", "<unk>", "<pad>", "[CLS]", "[SEP]", "[MASK]",
                   "<eos>", "<bos>", "<start_of_turn>", "<|eos|>", "[EOS]"]


def special_tokens(tokenizer_path: Path) -> dict[int, str]:
    from tokenizers import Tokenizer

    decoder = Tokenizer.from_file(str(tokenizer_path)).get_added_tokens_decoder()
    return {i: t.content for i, t in decoder.items() if t.special}


def token_stream(manifest_path: Path) -> np.ndarray:
    m = load_dataset_manifest(manifest_path)
    return np.concatenate([np.fromfile(manifest_path.parent / s.file, dtype=m.dtype) for s in m.shards])


def documents_with_every_special_token(specials: list[str]) -> list[str]:
    """Each special token's literal text alone, inside words, at both ends, and twice."""
    return [text for tok in specials for text in (tok, f"a {tok} b", f"x{tok}y{tok}", f"{tok} end", f"start {tok}")]


def assert_no_special_id_inside_a_document(manifest_path: Path, docs: list[str]) -> None:
    m = load_dataset_manifest(manifest_path)
    stream = token_stream(manifest_path)
    eos = m.import_info.eos_token_id
    assert m.import_info.documents == len(docs) == int((stream == eos).sum())  # one separator per document
    specials = set(special_tokens(manifest_path.parent / "tokenizer.json"))
    inside = stream[stream != eos]
    assert not specials & set(inside.tolist())
    assert decoded_documents(manifest_path) == docs  # the literal text, read back


@pytest.mark.parametrize("workers", [1, 2])
def test_special_token_text_in_a_document_is_encoded_as_text(tmp_path: Path, workers: int) -> None:
    """A document holding the literal text of any special token of the tokenizer (its end-of-document token
    included) gets no special id: the separators are exactly the documents."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(train_tokenizer(DOCS, 300))
    tok.add_special_tokens(FAMILY_SPECIALS)
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_str())
    specials = list(special_tokens(path).values())
    assert len(specials) == len(FAMILY_SPECIALS) + 1  # every one, <|endoftext|> too
    docs = documents_with_every_special_token(specials)
    (tmp_path / "d.jsonl").write_bytes(jsonl([{"text": t} for t in docs]))
    result = import_dataset(tmp_path / "root", "mine", "v1", [str(tmp_path / "d.jsonl")], tokenizer=str(path),
                            options=ImportOptions(shard_tokens=97), workers=workers)
    assert_no_special_id_inside_a_document(result.manifest_path, docs)


def test_special_token_text_with_the_tokenizer_trained_on_the_inputs(tmp_path: Path) -> None:
    docs = DOCS[:20] + documents_with_every_special_token(["<|endoftext|>"])
    (tmp_path / "d.jsonl").write_bytes(jsonl([{"text": t} for t in docs]))
    result = build(tmp_path / "root", [str(tmp_path / "d.jsonl")], vocab_size=300)
    assert list(special_tokens(result.manifest_path.parent / "tokenizer.json").values()) == ["<|endoftext|>"]
    assert_no_special_id_inside_a_document(result.manifest_path, docs)


def test_a_document_a_tokenizer_can_only_spell_with_a_special_token_is_a_bad_record(tmp_path: Path) -> None:
    """A word-level vocabulary that holds "</s>" as a word maps the text "</s>" to that id whatever the
    matching: the record is refused (file and line named), or skipped and counted with --skip-bad. Its unknown
    token stays allowed (it is how the model spells text it does not know, not a separator)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(sorted({w for d in DOCS for w in d.split()} | {"[UNK]", "</s>", "<pad>"}))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>", "<pad>", "[UNK]"])
    path = tmp_path / "wl.json"
    tok.save(str(path))
    lines = [{"text": DOCS[0]}, {"text": "w1 unknownword w2"}, {"text": "w1 </s> w2"}, {"text": DOCS[1]},
             {"text": "<pad>"}]
    (tmp_path / "d.jsonl").write_bytes(jsonl(lines))
    with pytest.raises(DataError, match=r"d\.jsonl:3: .*special token '</s>'.*--skip-bad"):
        build(tmp_path / "root", [str(tmp_path / "d.jsonl")], path)
    assert version_traces(tmp_path / "root") == []
    result = build(tmp_path / "root", [str(tmp_path / "d.jsonl")], path, skip_bad=True)
    assert result.manifest.import_info.skipped_records == 2 and result.manifest.import_info.documents == 3
    stream = token_stream(result.manifest_path)
    eos = result.manifest.import_info.eos_token_id
    assert int((stream == eos).sum()) == 3 and vocab["<pad>"] not in stream.tolist()
    assert vocab["[UNK]"] in stream.tolist()  # unknown text is the unknown token, as the model spells it


def test_reserved_ids_are_the_special_tokens_and_the_separator_but_not_the_unknown_token() -> None:
    assert reserved_ids({0: "<|endoftext|>", 5: "<pad>", 7: "[UNK]"}, 0, 7) == {0, 5}
    assert reserved_ids({}, 3, None) == {3}  # a plain token named with --eos-token is reserved too
    assert reserved_ids({3: "<unk>"}, 3, 3) == {3}  # the separator, even when it is the unknown token


@pytest.mark.parametrize("id_lists, expected", [
    ([[1, 2], [3]], []),
    ([[1, 9], [], [9, 9, 5], [2]], [(0, 9), (2, 9)]),
    ([[0], [1, 0, 5]], [(0, 0), (1, 0)]),  # the separator's id inside a document
    ([], []),
])
def test_documents_with_reserved_ids(id_lists: list[list[int]], expected: list[tuple[int, int]]) -> None:
    joined = join_documents(id_lists, eos_id=0)
    assert documents_with_reserved_ids(joined, [len(x) for x in id_lists], frozenset({0, 9})) == expected
