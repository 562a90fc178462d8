"""Who may see a dataset version, and what a reference resolves to for a tenant."""

from __future__ import annotations

import pytest

from trainyard_contract.records import DatasetRecord, dataset_candidates, dataset_visible, resolve_dataset


def record(tenant: str | None, shared_with: list[str] | None = None, name: str = "wiki") -> DatasetRecord:
    return DatasetRecord(name=name, version="v1", tenant=tenant, shared_with=shared_with or [],
                         manifest_uri="file:///x/manifest.json", sha256="a" * 64)


@pytest.mark.parametrize(("owner", "shared", "caller", "visible"), [
    (None, [], "b", True),          # the platform's: everyone
    ("a", [], "a", True),           # the owner
    ("a", [], "b", False),          # another tenant
    ("a", ["b"], "b", True),        # shared with it
    ("a", ["c"], "b", False),       # shared with someone else
    ("a", ["*"], "b", True),        # shared with every tenant
    ("a", [], None, False),         # no tenant at all
])
def test_visibility(owner: str | None, shared: list[str], caller: str | None, visible: bool) -> None:
    assert dataset_visible(record(owner, shared), caller) is visible


def test_the_qualified_ref_names_the_owner() -> None:
    assert record("a").ref == "a/wiki@v1" and record(None).ref == "wiki@v1"


def test_candidates_prefer_the_callers_own_then_the_platforms() -> None:
    assert dataset_candidates("wiki@v1", "b") == ["b/wiki@v1", "wiki@v1"]
    assert dataset_candidates("a/wiki@v1", "b") == ["a/wiki@v1"]
    with pytest.raises(ValueError):
        dataset_candidates("../wiki@v1", "b")


def test_resolution() -> None:
    own, platform, theirs = record("b"), record(None), record("a")
    shared = record("a", ["b"], name="shared")
    records = {r.ref: r for r in (own, platform, theirs, shared)}
    assert resolve_dataset("wiki@v1", "b", records) == own  # the caller's own shadows the platform's
    assert resolve_dataset("wiki@v1", "c", records) == platform
    assert resolve_dataset("a/wiki@v1", "b", records) is None  # not shared with b: same as unknown
    assert resolve_dataset("a/shared@v1", "b", records) == shared
    assert resolve_dataset("shared@v1", "b", records) is None  # unqualified never reaches another tenant's
    assert resolve_dataset("nope@v1", "b", records) is None
