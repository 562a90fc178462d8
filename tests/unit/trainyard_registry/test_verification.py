"""Verification of a published dataset version over what the shell read (no filesystem)."""

from __future__ import annotations

from typing import Any

import pytest

from trainyard_contract.events import DatasetVersionPublished
from trainyard_registry.verification import (
    FileSeen,
    VersionSeen,
    listed_files,
    ref_problem,
    rejection_reason,
    version_problems,
)

SHA, TOK, S0, S1 = "a" * 64, "b" * 64, "c" * 64, "d" * 64
DIR = "/art/tenants/acme/datasets/wiki/v1"


def manifest(**changes: Any) -> dict[str, Any]:
    m: dict[str, Any] = {
        "name": "wiki", "version": "v1", "tokenizer": {"file": "tokenizer.json", "sha256": TOK},
        "shards": [{"file": "shard-00000.bin", "sha256": S0, "sizeBytes": 10},
                   {"file": "shard-00001.bin", "sha256": S1, "sizeBytes": 4}],
    }
    return m | changes


GOOD_FILES = {"tokenizer.json": FileSeen(100, TOK), "shard-00000.bin": FileSeen(10, S0),
              "shard-00001.bin": FileSeen(4, S1)}


def event(**changes: Any) -> DatasetVersionPublished:
    fields: dict[str, Any] = dict(name="wiki", version="v1", tenant="acme",
                                  manifest_uri=f"file://{DIR}/manifest.json", sha256=SHA)
    return DatasetVersionPublished(**(fields | changes))


def seen(**changes: Any) -> VersionSeen:
    fields: dict[str, Any] = dict(expected_dir=DIR, manifest_path=f"{DIR}/manifest.json", inside=True,
                                  sha256=SHA, manifest=manifest(), files=GOOD_FILES)
    return VersionSeen(**(fields | changes))


def test_a_good_version_has_no_problems() -> None:
    assert version_problems(event(), seen()) == []


@pytest.mark.parametrize(("what", "changes", "expected"), [
    ("outside the prefix", dict(inside=False, manifest_path="/art/tenants/other/datasets/wiki/v1/manifest.json"),
     "not a file under the owner's dataset directory"),
    ("unreadable", dict(sha256=None), "cannot be read"),
    ("manifest sha", dict(sha256="e" * 64), "the manifest's sha256 is eeee"),
    ("not json", dict(manifest=None), "not a JSON object"),
    ("other name", dict(manifest=manifest(name="other")), "the manifest's name is 'other'"),
    ("no shards", dict(manifest=manifest(shards=[])), "lists no shards"),
    ("missing shard", dict(files={k: v for k, v in GOOD_FILES.items() if k != "shard-00001.bin"}),
     "shard-00001.bin is missing"),
    ("short shard", dict(files=GOOD_FILES | {"shard-00000.bin": FileSeen(9)}),
     "shard-00000.bin has 9 bytes, the manifest says 10"),
    ("corrupted shard", dict(files=GOOD_FILES | {"shard-00000.bin": FileSeen(10, "f" * 64)}),
     "shard-00000.bin: sha256 ffffffffffff… differs"),
    ("corrupted tokenizer", dict(files=GOOD_FILES | {"tokenizer.json": FileSeen(100, "f" * 64)}),
     "tokenizer.json: sha256"),
    ("path in a shard name", dict(manifest=manifest(shards=[{"file": "../../b/shard.bin", "sha256": S0}])),
     "is not a file name in the version's directory"),
])
def test_each_problem_is_named(what: str, changes: dict[str, Any], expected: str) -> None:
    problems = version_problems(event(), seen(**changes))
    assert any(expected in p for p in problems), (what, problems)


def test_outside_the_prefix_stops_there() -> None:
    assert len(version_problems(event(), seen(inside=False, manifest=None))) == 1


def test_listed_files_reads_the_tokenizer_and_shards() -> None:
    assert [(f.file, f.size) for f in listed_files(manifest())] == [
        ("tokenizer.json", None), ("shard-00000.bin", 10), ("shard-00001.bin", 4)]
    assert listed_files(["not", "a", "mapping"]) == []


@pytest.mark.parametrize(("changes", "ok"), [
    ({}, True), ({"tenant": None}, True), ({"tenant": "Bad Tenant"}, False), ({"name": "../x"}, False),
    ({"version": "v1/../../x"}, False),
])
def test_the_ref_must_be_plain_names(changes: dict[str, Any], ok: bool) -> None:
    assert (ref_problem(event(**changes)) is None) is ok


def test_reason_counts_the_rest() -> None:
    assert rejection_reason(["a"]) == "a"
    assert rejection_reason(["a", "b", "c"]) == "a (and 2 more problems)"
