"""Tenant-owned dataset versions against the real broker and Redis: the registry verifies a published
manifest and every shard before the version becomes visible, announces what it recorded
(ArtifactRegistered) or why it refused (DatasetRejected, reason also through the API), and the API
lists, resolves and accepts for training only what the caller's tenant may use."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from trainyard_api import ApiServer
from trainyard_contract import events as ev
from trainyard_contract.storage import sha256_file

from tests.integration.test_coordinator import Stack, TopicTail, publish, start_stack, stop_stack, wait_for
from tests.support.api import TOKEN_A, TOKEN_B, client_for, running_api, spec_with
from tests.support.datasets import published, write_dataset

A, B = "tenant-a", "tenant-b"  # the tenants of TOKEN_A and TOKEN_B


@pytest.fixture
async def stack(env: dict[str, Any]) -> AsyncIterator[tuple[Stack, TopicTail]]:
    s = await start_stack(env, with_registry=True)
    tail = TopicTail(env["kafka_bootstrap"], env["topic_namespace"], (ev.DATASETS, ev.REGISTRY))
    await tail.start()
    try:
        yield s, tail
    finally:
        await tail.stop()
        await stop_stack(s)


@pytest.fixture
async def api(env: dict[str, Any], stack: tuple[Stack, TopicTail]) -> AsyncIterator[ApiServer]:
    async with running_api(env) as server:
        yield server


def registered(tail: TopicTail, ref: str) -> list[ev.ArtifactRegistered]:
    return [e for e, _ in tail.of(ev.ArtifactRegistered, artifact_id=ref)]


def rejected(tail: TopicTail, event: ev.DatasetVersionPublished) -> list[ev.DatasetRejected]:
    return [e for e, _ in tail.of(ev.DatasetRejected, published_event_id=event.event_id)]


async def test_a_verified_version_is_recorded_for_its_tenant_announced_once_and_never_replaced(
    stack: tuple[Stack, TopicTail],
) -> None:
    s, tail = stack
    good = published(write_dataset(s.layout, "wiki", "v1", A), A, shared_with=[B])
    await publish(s, good, good, published(s.layout.dataset_dir("wiki", "v1", A) / "manifest.json", A))
    record = await wait_for(lambda: s.store.get_dataset(f"{A}/wiki@v1"), what="the verified version")
    assert (record.tenant, record.shared_with, record.sha256) == (A, [B], good.sha256)
    (announced,) = await wait_for(lambda: registered(tail, f"{A}/wiki@v1"), what="ArtifactRegistered")
    assert (announced.kind, announced.tenant, announced.dataset, announced.uri, announced.hash) == (
        "dataset", A, f"{A}/wiki@v1", good.manifest_uri, good.sha256)
    assert announced.shared_with == [B] and announced.num_tokens == good.num_tokens
    assert await s.store.get_dataset("wiki@v1") is None  # a tenant's version is not the platform's

    conflicting = good.model_copy(update={"event_id": uuid.uuid4(), "sha256": "f" * 64})
    await publish(s, conflicting)
    (refusal,) = await wait_for(lambda: rejected(tail, conflicting), what="DatasetRejected for the conflict")
    assert "already published with sha256" in refusal.reason and refusal.tenant == A
    assert (await s.store.get_dataset(f"{A}/wiki@v1")) == record  # the first stays
    # the same-sha re-publishes came before the conflict on the same partition: announced once only
    assert len(registered(tail, f"{A}/wiki@v1")) == 1


async def test_bad_versions_are_rejected_and_only_their_owner_sees_why(
    stack: tuple[Stack, TopicTail], api: ApiServer,
) -> None:
    s, tail = stack
    wrong_sha = published(write_dataset(s.layout, "wrongsha", "v1", A), A, sha256="0" * 64)
    corrupt_manifest = write_dataset(s.layout, "corrupt", "v1", A)
    corrupt = published(corrupt_manifest, A)
    shard = corrupt_manifest.parent / "shard-00001.bin"
    shard.write_bytes(bytes(reversed(shard.read_bytes())))  # same size, other bytes
    theirs = write_dataset(s.layout, "stolen", "v1", A)
    outside = published(theirs, B)  # B claims A's files as its own
    link = s.layout.dataset_dir("linked", "v1", B)
    link.parent.mkdir(parents=True)
    os.symlink(theirs.parent, link)  # …or links its prefix to them
    through_link = published(theirs, B, name="linked", manifest_uri=(link / "manifest.json").as_uri())
    await publish(s, wrong_sha, corrupt, outside, through_link)

    expected = [
        (wrong_sha, "the manifest's sha256 is "), (corrupt, "shard-00001.bin: sha256"),
        (outside, "is not a file under the owner's dataset directory"),
        (through_link, "is not a file under the owner's dataset directory"),
    ]
    for event, says in expected:
        (refusal,) = await wait_for(lambda e=event: rejected(tail, e), what=f"DatasetRejected for {event.name}")
        assert says in refusal.reason, refusal
        assert await s.store.get_dataset(ev.dataset_key(event.tenant, event.name, event.version)) is None
    assert sha256_file(theirs) == published(theirs, A).sha256  # A's own files untouched

    async with client_for(api.url, TOKEN_A) as a, client_for(api.url, TOKEN_B) as b:
        resp = await a.get(f"/v1/datasets/{A}/corrupt@v1")
        assert resp.status_code == 200, resp.text
        view = resp.json()
        assert view["state"] == "rejected" and "shard-00001.bin: sha256" in view["reason"], view
        assert (await a.get("/v1/datasets/corrupt@v1")).json()["state"] == "rejected"  # unqualified: its own
        assert (await b.get(f"/v1/datasets/{A}/corrupt@v1")).status_code == 404
        listed = {d["name"] for d in (await a.get("/v1/datasets")).json()["datasets"]}
        assert listed == {"tinycorpus"}  # nothing rejected is listed
        resp = await b.get(f"/v1/datasets/{B}/stolen@v1")
        assert resp.json()["state"] == "rejected" and "owner's dataset directory" in resp.json()["reason"]


async def test_a_tenant_publishes_through_the_api_and_only_those_it_shares_with_see_or_train_on_it(
    stack: tuple[Stack, TopicTail], api: ApiServer,
) -> None:
    s, _ = stack
    shared = write_dataset(s.layout, "shared", "v1", A)
    private = write_dataset(s.layout, "private", "v1", A)
    async with client_for(api.url, TOKEN_A) as a, client_for(api.url, TOKEN_B) as b:
        for manifest, share in ((shared, [B]), (private, [])):
            resp = await a.post("/v1/datasets", json={
                "name": manifest.parent.parent.name, "version": "v1", "sha256": sha256_file(manifest),
                "sharedWith": share, "manifestUri": "file:///etc/passwd"})
            assert resp.status_code == 422 and "manifestUri" in resp.text, resp.text  # never a client's path
            resp = await a.post("/v1/datasets", json={
                "name": manifest.parent.parent.name, "version": "v1", "sha256": sha256_file(manifest),
                "sharedWith": share})
            assert resp.status_code == 202, resp.text
            location = resp.headers["location"]

            async def verified(url: str = location) -> Any:
                got = await a.get(url)
                return got.status_code == 200 and got.json()["state"] == "verified"
            await wait_for(verified, what=f"{location} verified")
        assert (await b.post("/v1/datasets", json={"name": "x", "version": "v1", "sha256": "0" * 64,
                                                   "sharedWith": ["Not A Tenant"]})).status_code == 422

        seen_by_b = {(d["tenant"], d["name"]) for d in (await b.get("/v1/datasets")).json()["datasets"]}
        assert seen_by_b == {(None, "tinycorpus"), (A, "shared")}
        assert (await b.get(f"/v1/datasets/{A}/shared@v1")).json()["sharedWith"] == [B]
        for ref in (f"{A}/private@v1", "private@v1"):
            assert (await b.get(f"/v1/datasets/{ref}")).status_code == 404

        # training: B may use what is shared with it, never A's private version (qualified or not)
        messages = set()
        for ref in (f"{A}/private@v1", "private@v1", f"{A}/nothing@v1"):
            resp = await b.post("/v1/training-jobs", json=spec_with(dataset=ref))
            assert resp.status_code == 422, resp.text
            (problem,) = [d for d in resp.json()["detail"] if d["field"] == "dataset"]
            messages.add(problem["message"].replace(repr(ref), "REF"))
        assert len(messages) == 1  # unknown and not visible read the same
        resp = await b.post("/v1/training-jobs", json=spec_with(dataset=f"{A}/shared@v1"))
        assert resp.status_code == 202, resp.text
        job = (await b.get(f"/v1/training-jobs/{resp.json()['jobId']}")).json()
        assert job["spec"]["dataset"] == f"{A}/shared@v1"

        # the owner's unqualified ref resolves to its own version, and the stored spec names it qualified
        resp = await a.post("/v1/training-jobs", json=spec_with(dataset="private@v1"))
        assert resp.status_code == 202, resp.text
        job = (await a.get(f"/v1/training-jobs/{resp.json()['jobId']}")).json()
        assert job["spec"]["dataset"] == f"{A}/private@v1"


async def test_datasets_import_publish_builds_under_the_callers_prefix_and_the_registry_verifies_it(
    stack: tuple[Stack, TopicTail], api: ApiServer, tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from trainyard_cli.main import app

    s, tail = stack
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(200)))
    args = ["--api-url", api.url, "--token", TOKEN_A, "datasets", "import", "--publish", "--share", B,
            "--name", "notes", "--version", "v1", "--artifact-root", str(s.layout.root), "--vocab-size", "300",
            "--workers", "1", "--no-progress", str(corpus)]
    result = await asyncio.to_thread(CliRunner().invoke, app, args)
    assert result.exit_code == 0, result.output
    manifest = s.layout.dataset_dir("notes", "v1", A) / "manifest.json"
    assert manifest.is_file() and not s.layout.dataset_dir("notes", "v1").exists()  # under A's prefix only

    record = await wait_for(lambda: s.store.get_dataset(f"{A}/notes@v1"), what="the imported version verified")
    assert (record.sha256, record.shared_with) == (sha256_file(manifest), [B])
    await wait_for(lambda: registered(tail, f"{A}/notes@v1"), what="ArtifactRegistered")
    async with client_for(api.url, TOKEN_B) as b:
        assert (await b.get(f"/v1/datasets/{A}/notes@v1")).json()["state"] == "verified"


async def test_a_re_publish_with_another_sha256_is_refused_visibly_and_the_first_version_stays(
    stack: tuple[Stack, TopicTail], api: ApiServer,
) -> None:
    """Through the API the conflict is a 409 at once; what reaches the registry anyway (a pipeline's event on
    the bus) is refused there, and the owner's GET shows that refusal, with its reason, beside the verified
    version — which keeps its sha256 and files. The publish's Location answers for that publish's content."""
    s, tail = stack
    manifest = write_dataset(s.layout, "wiki", "v1", A)
    first, other = sha256_file(manifest), "f" * 64
    ref = f"/v1/datasets/{A}/wiki@v1"
    async with client_for(api.url, TOKEN_A) as a, client_for(api.url, TOKEN_B) as b:
        resp = await a.post("/v1/datasets", json={"name": "wiki", "version": "v1", "sha256": first,
                                                  "sharedWith": [B]})
        assert resp.status_code == 202, resp.text
        location = resp.headers["location"]
        assert location.endswith(f"{ref}?sha256={first}")

        async def state(url: str = location, **params: str) -> Any:
            got = await a.get(url, params=params)
            return got.status_code == 200 and got.json()["state"]
        assert await wait_for(state, what="the first publish verified") == "verified"

        resp = await a.post("/v1/datasets", json={"name": "wiki", "version": "v1", "sha256": other})
        assert resp.status_code == 409, resp.text
        assert f"already published with sha256 {first}" in resp.json()["detail"] and other in resp.json()["detail"]
        again = await a.post("/v1/datasets", json={"name": "wiki", "version": "v1", "sha256": first})
        assert again.status_code == 202  # the same content again: accepted, changes nothing

        conflicting = published(manifest, A, sha256=other, shared_with=[B])
        await publish(s, conflicting)
        await wait_for(lambda: rejected(tail, conflicting), what="DatasetRejected for the conflict")
        view = (await a.get(ref)).json()
        assert (view["state"], view["sha256"]) == ("verified", first), view
        (refusal,) = view["rejections"]
        assert refusal["sha256"] == other and refusal["publishedEventId"] == str(conflicting.event_id)
        assert f"already published with sha256 {first}" in refusal["reason"] and refusal["rejectedAt"]
        that = (await a.get(ref, params={"sha256": other})).json()  # what the publish of `other` came to
        assert that["state"] == "rejected" and f"already published with sha256 {first}" in that["reason"], that
        assert await state() == "verified"  # the first publish's Location: still verified

        shared = (await b.get(ref)).json()  # B may use the version, not read why A's publishes were refused
        assert shared["state"] == "verified" and shared["rejections"] == []
        assert (await b.get(ref, params={"sha256": other})).status_code == 404
        assert (await a.get(ref, params={"sha256": "e" * 64})).status_code == 404  # not decided: not yet
        bad = await a.get(ref, params={"sha256": "not-a-sha"})
        assert bad.status_code == 422 and "sha256" in bad.text
        record = await s.store.get_dataset(f"{A}/wiki@v1")
        assert record is not None and record.sha256 == first == sha256_file(manifest)  # the first stays


async def test_a_refusal_of_the_same_content_is_cleared_when_it_verifies_and_one_of_other_content_stays(
    stack: tuple[Stack, TopicTail], api: ApiServer,
) -> None:
    s, tail = stack
    wrong = published(write_dataset(s.layout, "late", "v1", A), A, sha256="0" * 64)  # a typo'd sha256
    manifest = s.layout.dataset_dir("late", "v1", A) / "manifest.json"
    right = published(manifest, A)
    await publish(s, wrong, right)
    await wait_for(lambda: registered(tail, f"{A}/late@v1"), what="the right sha256 verified")
    in_place = write_dataset(s.layout, "early", "v1", A)
    early = published(in_place, A)
    moved = in_place.rename(in_place.with_name("manifest.moved"))  # published before it is in place
    await publish(s, early)
    await wait_for(lambda: rejected(tail, early), what="the early publish refused")
    moved.rename(in_place)
    await publish(s, early.model_copy(update={"event_id": uuid.uuid4()}))
    await wait_for(lambda: registered(tail, f"{A}/early@v1"), what="the same content verified")
    async with client_for(api.url, TOKEN_A) as a:
        late = (await a.get(f"/v1/datasets/{A}/late@v1")).json()
        assert late["state"] == "verified" and [r["sha256"] for r in late["rejections"]] == ["0" * 64]
        assert (await a.get(f"/v1/datasets/{A}/late@v1", params={"sha256": "0" * 64})).json()["state"] == "rejected"
        cleared = (await a.get(f"/v1/datasets/{A}/early@v1")).json()
        assert cleared["state"] == "verified" and cleared["rejections"] == []


async def test_datasets_import_publish_shows_the_registrys_refusal_and_a_conflict(
    stack: tuple[Stack, TopicTail], api: ApiServer, tmp_path: Path,
) -> None:
    """The CLI's follow-up, against the real API and registry: an import into another artifact root than the
    platform's is refused by the registry (its manifest is not where the tenant's prefix says) and the CLI
    says why, exit 1; other content published under a verified name@version is the API's 409, exit 1, and
    `trainyard datasets get` shows the version as it stands."""
    from typer.testing import CliRunner

    from trainyard_cli.main import app

    s, _ = stack
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i}: a b c d e f g" for i in range(100)))
    common = ["--api-url", api.url, "--token", TOKEN_A, "datasets", "import", "--publish", "--name", "notes",
              "--vocab-size", "300", "--workers", "1", "--no-progress", "--wait-timeout", "60"]

    def run(*args: str) -> Any:
        return CliRunner().invoke(app, [*common, *args])
    elsewhere = await asyncio.to_thread(run, "--version", "v1", "--artifact-root", str(tmp_path / "mine"),
                                        str(corpus))
    assert elsewhere.exit_code == 1, elsewhere.output
    assert "the registry refused tenant-a/notes@v1: " in elsewhere.output, elsewhere.output
    assert "not a file under the owner's dataset directory" in elsewhere.output

    first = await asyncio.to_thread(run, "--version", "v2", "--artifact-root", str(s.layout.root), str(corpus))
    assert first.exit_code == 0 and "tenant-a/notes@v2 is verified" in first.output, first.output
    manifest = s.layout.dataset_dir("notes", "v2", A) / "manifest.json"
    sha = sha256_file(manifest)
    other_root = tmp_path / "other"  # other content under the same name@version, built elsewhere
    corpus.write_text("other content entirely " * 50)
    conflict = await asyncio.to_thread(run, "--version", "v2", "--artifact-root", str(other_root), str(corpus))
    assert conflict.exit_code == 1 and f"already published with sha256 {sha}" in conflict.output, conflict.output

    shown = await asyncio.to_thread(CliRunner().invoke, app, ["--api-url", api.url, "--token", TOKEN_A, "datasets",
                                                              "get", f"{A}/notes@v2"])
    assert shown.exit_code == 0 and "state        verified" in shown.output and f"sha256       {sha}" in shown.output
    assert sha256_file(manifest) == sha
