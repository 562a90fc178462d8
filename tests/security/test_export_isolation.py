"""An export is converted by the registry (root) from a checkpoint directory that belongs to the job's user: a rank
of the job (or of a later job of its tenant) can swap a shard, or the step directory, for a symbolic link after
the checkpoint became READY. The conversion must never read through such a link — it would put whatever the link
names (another tenant's weights) into the attacker's export. The export worker copies the checkpoint through
handles walked from the artifact root without following a link, verified as it copies, and converts the copy.

Real broker, Redis, coordinator, registry and conversion command."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from trainyard_contract import events as ev
from tests.integration.test_coordinator import TENANT, Stack, given_job, publish, start_stack, stop_stack, wait_for
from tests.integration.test_registry_exports import export_failed, ready_artifact, settled

pytestmark = [pytest.mark.integration, pytest.mark.security]


@pytest.fixture
async def stack(env: dict[str, Any]) -> AsyncIterator[Stack]:
    s = await start_stack(env, with_registry=True, registry={"export_timeout_s": 120},
                          tail_topics=(ev.REGISTRY, ev.EXPORTS, ev.DEADLETTER))
    try:
        yield s
    finally:
        await stop_stack(s)


async def export(stack: Stack, job_id: str, artifact_id: str) -> tuple[str, Any]:
    asked = ev.ExportRequested(export_id=ev.export_id(artifact_id, "hf"), checkpoint_artifact_id=artifact_id,
                               job_id=job_id, tenant=TENANT, format="hf", requested_by="tok_attacker")
    await publish(stack, asked)
    record = await wait_for(lambda: settled(stack, asked.export_id), timeout_s=180, what="the export settled")
    return asked.export_id, record


async def test_an_export_never_reads_through_a_link_the_rank_swapped_in(stack: Stack, tmp_path) -> None:
    job_id = "job-export-swap"
    epoch = await given_job(stack, job_id)
    shard_swapped = await ready_artifact(stack, job_id, 20, epoch)
    dir_swapped = await ready_artifact(stack, job_id, 40, epoch)

    # 1. a shard replaced by a link to a file elsewhere with the very same bytes: the hashes match, so only
    #    "never follow" refuses it (the link could as well name another tenant's shard the moment after)
    step20 = stack.layout.checkpoint_dir(TENANT, job_id, 1, 20)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shard = step20 / "__0_0.distcp"
    shutil.copyfile(shard, elsewhere / shard.name)
    shard.unlink()
    shard.symlink_to(elsewhere / shard.name)
    export_id, record = await export(stack, job_id, shard_swapped)
    assert record.state == "failed" and "symbolic link" in record.reason and "refused" in record.reason, record
    (failed,) = await wait_for(lambda: export_failed(stack, export_id), what="ExportFailed")
    assert failed.reason == record.reason

    # 2. the step directory replaced by a link to a copy of itself (any directory: another tenant's checkpoint)
    step40 = stack.layout.checkpoint_dir(TENANT, job_id, 1, 40)
    copy = tmp_path / "copy-of-step-40"
    shutil.copytree(step40, copy)
    shutil.rmtree(step40)
    step40.symlink_to(copy, target_is_directory=True)
    export_id, record = await export(stack, job_id, dir_swapped)
    assert record.state == "failed" and "symbolic link" in record.reason, record

    # nothing was converted from either: no export directory, no export artifact, and the links' targets untouched
    assert not stack.layout.exports_dir(TENANT, job_id).exists() or \
        list(stack.layout.exports_dir(TENANT, job_id).rglob("*.safetensors")) == []
    assert {a.type for a in await stack.store.list_artifacts(job_id)} <= {"checkpoint", "model"}
    assert (copy / "manifest.json").exists() and (elsewhere / shard.name).exists()


# The conversion, standing in for trainyard-export: while it runs, "the rank" swaps the job's original shard for a
# link to another tenant's bytes (the race a check-then-read by path loses); then it reads the shard its manifest
# names, as DCP would, and reports what it read.
RACING_CONVERSION = r"""
import json, os, pathlib, sys
from urllib.parse import unquote, urlsplit
args = sys.argv[1:]
manifest = pathlib.Path(args[args.index("--checkpoint") + 1])
manifest = manifest if manifest.name == "manifest.json" else manifest / "manifest.json"
original = pathlib.Path(os.environ["ORIGINAL_SHARD"])
original.unlink()
original.symlink_to(os.environ["VICTIM_SHARD"])
shard = json.loads(manifest.read_text())["shards"][0]["uri"]
read = pathlib.Path(unquote(urlsplit(shard).path)).read_bytes()
pathlib.Path(os.environ["CONVERSION_READ"]).write_bytes(read)
sys.exit(1)
"""


async def test_a_shard_swapped_while_the_conversion_runs_is_not_what_it_reads(
        env: dict[str, Any], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "racing_conversion.py"
    script.write_text(RACING_CONVERSION)
    s = await start_stack(env, with_registry=True,
                          registry={"export_timeout_s": 120, "export_command": [sys.executable, str(script)]},
                          tail_topics=(ev.REGISTRY, ev.EXPORTS, ev.DEADLETTER))
    try:
        job_id = "job-export-race"
        epoch = await given_job(s, job_id)
        artifact = await ready_artifact(s, job_id, 20, epoch)
        original = s.layout.checkpoint_dir(TENANT, job_id, 1, 20) / "__0_0.distcp"
        verified = original.read_bytes()
        victim = tmp_path / "victim-shard.distcp"
        victim.write_bytes(b"another tenant's weights" * 100)
        monkeypatch.setenv("ORIGINAL_SHARD", str(original))
        monkeypatch.setenv("VICTIM_SHARD", str(victim))
        monkeypatch.setenv("CONVERSION_READ", str(tmp_path / "read"))
        _, record = await export(s, job_id, artifact)
        assert record.state == "failed"  # the stand-in converts nothing
        assert original.is_symlink(), "the swap happened while the conversion ran"
        read = (tmp_path / "read").read_bytes()
        assert read == verified and read != victim.read_bytes(), "the conversion read the bytes that were verified"
    finally:
        await stop_stack(s)


async def test_a_shard_made_a_fifo_or_grown_huge_is_refused_without_blocking_or_reading_it_all(stack: Stack) -> None:
    """The registry reads a rank's files as hostile: a FIFO is never opened for a blocking read (the export worker
    would hang for good), and a shard grown to 20 GiB after it was verified is read only one byte past the size its
    manifest says, then refused."""
    job_id = "job-export-weapons"
    epoch = await given_job(stack, job_id)
    fifo_artifact = await ready_artifact(stack, job_id, 20, epoch)
    huge_artifact = await ready_artifact(stack, job_id, 40, epoch)
    fifo = stack.layout.checkpoint_dir(TENANT, job_id, 1, 20) / "__0_0.distcp"
    fifo.unlink()
    os.mkfifo(fifo)
    huge = stack.layout.checkpoint_dir(TENANT, job_id, 1, 40) / "__0_0.distcp"
    with open(huge, "r+b") as fh:
        fh.truncate(20 << 30)
    _, record = await export(stack, job_id, fifo_artifact)
    assert record.state == "failed" and "not a regular file: refused" in record.reason, record
    _, record = await export(stack, job_id, huge_artifact)
    assert record.state == "failed" and "failed verification" in record.reason, record
    assert {a.type for a in await stack.store.list_artifacts(job_id)} <= {"checkpoint", "model"}  # no export
