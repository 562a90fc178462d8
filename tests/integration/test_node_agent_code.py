"""The node agent runs a job's own code (``spec.code``), as real processes against the real broker
and Redis: the archive (packed with ``codetree.pack``, stored where the API stores uploads) is
materialised once into the node's read-only code cache, each rank runs the entrypoint in
``<tree>/<workingDir>`` with the rank contract plus ``code.env`` and ``TRAINYARD_CODE_DIR``; a
tampered cache entry is moved aside (quarantined; deleted once no rank runs the archive) and
extracted again before the next attempt runs; a script that cannot import,
a missing entrypoint or workingDir and an archive that is not the one named end as ``config``."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_node_agent import reap_ranks  # noqa: F401 - autouse: no rank outlives a test
from tests.integration.test_node_agent_failures import NODE, Rig, heartbeat_after, rig  # noqa: F401 - fixture
from tests.integration.test_scheduler_stack import make_spec, poll
from trainyard_contract.codetree import archive_id, pack
from trainyard_contract.events import GangAllocated, WorkerExited
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.spec import TrainingSpec
from trainyard_contract.storage import ArtifactLayout

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TENANT = "t1"  # Rig.gang's tenant

# What every rank of the job sees, written to the job's checkpoint prefix (where user code may write).
REPORT = r"""
import json, os, pathlib, stat, sys
import helper  # a module beside the script: the working directory is the script's
env = os.environ
out = pathlib.Path(env["TRAINYARD_ARTIFACT_ROOT"], "tenants", env["TRAINYARD_TENANT"], "jobs",
                   env["TRAINYARD_JOB_ID"], "checkpoints")
out.mkdir(parents=True, exist_ok=True)
cwd = pathlib.Path.cwd()
(out / f"seen-a{env['TRAINYARD_ATTEMPT']}-r{env['RANK']}.json").write_text(json.dumps({
    "rank": env["RANK"], "worldSize": env["WORLD_SIZE"], "localRank": env["LOCAL_RANK"], "cwd": str(cwd),
    "codeDir": env["TRAINYARD_CODE_DIR"], "scratch": env["TRAINYARD_SCRATCH_DIR"],
    "scratchExists": os.path.isdir(env["TRAINYARD_SCRATCH_DIR"]), "greeting": env.get("GREETING"),
    "argv": sys.argv[1:], "helper": helper.NAME, "events": env["TRAINYARD_EVENTS_FILE"],
    "dirMode": stat.S_IMODE(cwd.stat().st_mode), "fileMode": stat.S_IMODE(os.stat(__file__).st_mode),
}))
"""
TAMPERED = r"""
import os, pathlib
pathlib.Path(os.environ["TRAINYARD_ARTIFACT_ROOT"], "tampered-code-ran").write_text("yes")
"""


def store_archive(layout: ArtifactLayout, src: Path, files: dict[str, str]) -> str:
    """Pack ``files`` (path → text) with codetree.pack and store the archive where the API does."""
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    data = pack(src, list(files))
    ident = archive_id(data)
    path = layout.code_archive(TENANT, ident.removeprefix("sha256:"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return ident


def code_spec(world: int, **code: Any) -> TrainingSpec:
    wire = make_spec(world).model_dump(by_alias=True, mode="json")
    return TrainingSpec.model_validate({**wire, "code": code})


async def run_gang(rig: Rig, job_id: str, spec: TrainingSpec, *, world: int = 1,
                   attempt: int = 1) -> tuple[GangAllocated, dict[int, WorkerExited]]:
    """Publish the gang, wait for every rank's exit, release its devices (playing the scheduler)."""
    gang = await rig.gang(job_id, world=world, attempt=attempt, spec=spec)
    exits = await rig.tap.wait(WorkerExited, world, job_id=job_id, attempt=attempt, timeout_s=90)
    await LeaseManager(rig.redis).release(gang.allocation_id, gang.epoch, [Device(NODE, i) for i in range(world)])
    return gang, {e.rank: e for e in exits}


@pytest.fixture
def layout(rig: Rig) -> ArtifactLayout:
    return ArtifactLayout(rig.env["artifact_root"])


async def test_user_code_runs_in_its_read_only_tree_and_a_tampered_tree_is_extracted_again(
        rig: Rig, layout: ArtifactLayout, tmp_path: Path) -> None:
    archive = store_archive(layout, tmp_path / "src", {"src/train.py": REPORT, "src/helper.py": "NAME = 'helper'\n",
                                                       "README.md": "a user's project\n"})
    cache = tmp_path / "code-cache"
    rig.services.start("trainyard_node_agent", "agent", **rig.agent_settings, code_cache_dir=cache)
    await heartbeat_after(rig.tap)
    spec = code_spec(2, archive=archive, entrypoint=[sys.executable, "train.py", "--lr", "3e-4"],
                     workingDir="src", env={"GREETING": "hello"}, image="ghcr.io/acme/train:1")

    _, exits = await run_gang(rig, "own-code", spec, world=2)
    assert {(r, e.reason, e.exit_code) for r, e in exits.items()} == {(0, "ok", 0), (1, "ok", 0)}, exits
    tree = cache / archive.removeprefix("sha256:") / "tree"
    out = layout.checkpoints_dir(TENANT, "own-code")
    seen = {r: json.loads((out / f"seen-a1-r{r}.json").read_text()) for r in (0, 1)}
    for r, s in seen.items():
        assert (s["rank"], s["worldSize"], s["localRank"]) == (str(r), "2", str(r))
        assert (s["cwd"], s["codeDir"]) == (str(tree / "src"), str(tree))
        assert (s["greeting"], s["argv"], s["helper"]) == ("hello", ["--lr", "3e-4"], "helper")
        assert s["events"] == str(layout.rank_events(TENANT, "own-code", 1, r))
        assert s["scratch"] == str(layout.attempt_dir(TENANT, "own-code", 1) / "scratch" / f"rank-{r}")
        assert s["scratchExists"]
        assert (s["dirMode"], s["fileMode"]) == (0o555, 0o444)  # the tree is read-only
    assert "image ghcr.io/acme/train:1" in rig.services.log("agent")  # recorded in the agent's log

    # someone edits the cached tree: the next attempt must run the archive's code, not theirs
    script = tree / "src" / "train.py"
    os.chmod(script.parent, 0o755)
    os.chmod(script, 0o644)
    script.write_text(TAMPERED)
    _, exits = await run_gang(rig, "own-code", spec, world=1, attempt=2)
    assert exits[0].reason == "ok", exits
    assert (out / "seen-a2-r0.json").exists()
    assert not (layout.root / "tampered-code-ran").exists()
    assert hashlib.sha256(script.read_bytes()).hexdigest() == hashlib.sha256(REPORT.encode()).hexdigest()
    assert stat.S_IMODE(script.stat().st_mode) == 0o444
    assert "does not match its digest" in rig.services.log("agent")

    # the tampered copy was moved aside, not deleted under attempt 1; once no rank runs the archive it goes
    quarantine = cache / ".quarantine"

    async def purged() -> bool:
        return quarantine.is_dir() and not any(quarantine.iterdir())

    await poll(purged, "the quarantined tree to be deleted once no rank of the archive runs")


async def test_code_that_cannot_run_fails_its_ranks_as_config(rig: Rig, layout: ArtifactLayout,
                                                              tmp_path: Path) -> None:
    broken = store_archive(layout, tmp_path / "broken", {"train.py": "import does_not_exist\n"})
    rig.services.start("trainyard_node_agent", "agent", **rig.agent_settings, code_cache_dir=tmp_path / "cache")
    await heartbeat_after(rig.tap)

    _, exits = await run_gang(rig, "no-module", code_spec(1, archive=broken, entrypoint=[sys.executable, "train.py"]))
    assert (exits[0].reason, exits[0].exit_code) == ("config", 1), exits
    assert "ModuleNotFoundError: No module named 'does_not_exist'" in (exits[0].detail or "")

    _, exits = await run_gang(rig, "no-entry", code_spec(1, archive=broken, entrypoint=["./missing.sh"]))
    assert exits[0].reason == "config" and (exits[0].detail or "").startswith("entrypoint not found: "), exits
    assert "missing.sh" in (exits[0].detail or "")

    _, exits = await run_gang(rig, "no-dir", code_spec(1, archive=broken, entrypoint=["python"], workingDir="nope"))
    assert exits[0].reason == "config" and "workingDir 'nope'" in (exits[0].detail or ""), exits

    # an archive whose bytes are not the ones the job names (replaced after upload): never run
    named = "sha256:" + "ab" * 32
    elsewhere = layout.code_archive(TENANT, "ab" * 32)
    elsewhere.write_bytes(layout.code_archive(TENANT, broken.removeprefix("sha256:")).read_bytes())
    _, exits = await run_gang(rig, "wrong-hash", code_spec(1, archive=named, entrypoint=[sys.executable, "train.py"]))
    assert exits[0].reason == "config" and f"not the {named}" in (exits[0].detail or ""), exits
    assert not (tmp_path / "cache" / ("ab" * 32)).exists()
    assert "not running it" in rig.services.log("agent")  # logged before the exit was reported
