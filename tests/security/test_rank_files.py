"""Files a rank writes that its node agent reads — its exit note and its event spool — used as weapons
against a real sandboxed node agent (TRAINYARD_NODE_SANDBOX=enforce), the real broker and Redis.

- An exit note that is a FIFO (a synchronous read would block the agent's event loop for good: no more
  heartbeats, every rank on the node unwatched), a symlink to ``/dev/zero`` (endless), or a 20 GiB sparse
  file (memory): each is refused with a named reason in the rank's WorkerExited, and the agent keeps
  heartbeating.
- A spool line starting with a NUL byte, and one that is not UTF-8 (UnicodeDecodeError, not a
  JSONDecodeError): each is dead-lettered, and the events after it are still relayed.

All the while a victim job of another tenant runs on the same node and ends ``ok``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trainyard_contract.events import DeadLetter, NodeHeartbeat, StepMetrics, WorkerExited, WorkerStarted
from trainyard_runtime.leases import Device, LeaseManager
from trainyard_contract.storage import ArtifactLayout

from tests.integration.test_node_agent import reap_ranks  # noqa: F401 - autouse: no rank outlives a test
from tests.integration.test_node_agent_failures import NODE, Rig, heartbeat_after, rig  # noqa: F401 - fixture
from tests.security.test_rank_sandbox import VICTIM, VICTIM_TENANT, code_spec, gang, start_agent, store_archive
from tests.support.responsiveness import report

pytestmark = [pytest.mark.integration, pytest.mark.security, pytest.mark.slow]

ATTACKER_TENANT = "t1"
# Writes StepMetrics 1, two undecodable lines, StepMetrics 2; then makes its exit note what NOTE says; exits 0.
ATTACKER = r"""
import json, os, uuid
from datetime import datetime, timezone
env = os.environ

def step(n):
    payload = {"eventType": "StepMetrics", "eventId": str(uuid.uuid4()), "schemaVersion": 1,
               "occurredAt": datetime.now(timezone.utc).isoformat(), "jobId": env["TRAINYARD_JOB_ID"],
               "tenant": env["TRAINYARD_TENANT"], "attempt": int(env["TRAINYARD_ATTEMPT"]),
               "rank": int(env["RANK"]), "step": n, "loss": 1.0, "consumedTokens": n}
    return json.dumps({"topic": "trainyard.metrics", "key": env["TRAINYARD_JOB_ID"], "traceparent": None,
                       "payload": payload}).encode() + b"\n"

with open(env["TRAINYARD_EVENTS_FILE"], "ab") as spool:
    spool.write(step(1))
    if env["SPOOL"] == "poison":
        spool.write(b'\x00{"topic": "trainyard.metrics"}\n')  # UnicodeDecodeError in json.loads(bytes)
        spool.write(b'{"topic": "\xff\xfe"}\n')  # invalid UTF-8
    spool.write(step(2))
note = env["TRAINYARD_EXIT_NOTE_FILE"]
if env["NOTE"] == "fifo":
    os.mkfifo(note)
elif env["NOTE"] == "dev-zero":
    os.symlink("/dev/zero", note)
elif env["NOTE"] == "huge":
    with open(note, "wb") as fh:
        fh.truncate(20 << 30)
print("attack planted", env["NOTE"], env["SPOOL"], flush=True)
"""
ATTACKS = {  # job → (exit note, spool, what the WorkerExited detail must say)
    "note-fifo": ("fifo", "clean", "exit note refused: not a regular file (a FIFO)"),
    "note-dev-zero": ("dev-zero", "clean", "exit note refused: a symlink (never followed)"),
    "note-huge": ("huge", "clean", "exit note refused: too large (21474836480 bytes"),
    "spool-nul": ("none", "poison", None),
}


async def test_a_rank_file_that_is_a_weapon_is_refused_and_the_agent_stays_responsive(
        rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = ArtifactLayout(rig.env["artifact_root"])
    dataset = layout.dataset_dir("tinycorpus", "v1")  # make_spec's
    dataset.mkdir(parents=True)
    (dataset / "manifest.json").write_text('{"the": "manifest"}')  # the victim reads it
    agent = start_agent(rig, tmp_path, monkeypatch)
    await heartbeat_after(rig.tap)
    victim_code = store_archive(layout, VICTIM_TENANT, tmp_path / "victim", {"main.py": VICTIM})
    await gang(rig, "victim", VICTIM_TENANT, 0, code_spec(victim_code, {"SECRET": "s"}))
    try:
        await rig.tap.wait(WorkerStarted, job_id="victim", timeout_s=60)
    except AssertionError as exc:
        raise AssertionError(rig.services.log("agent")[-6000:]) from exc

    code = store_archive(layout, ATTACKER_TENANT, tmp_path / "attacker", {"main.py": ATTACKER})
    for device, (job, (note, spool, _)) in enumerate(ATTACKS.items(), start=1):
        await gang(rig, job, ATTACKER_TENANT, device, code_spec(code, {"NOTE": note, "SPOOL": spool}))
    exits = {e.job_id: e for e in await rig.tap.wait(WorkerExited, len(ATTACKS), timeout_s=120)
             if e.job_id in ATTACKS}
    assert set(exits) == set(ATTACKS), exits
    for job, (_, _, why) in ATTACKS.items():
        exited = exits[job]
        assert (exited.exit_code, exited.reason) == (0, "ok"), exited  # its own status, from the launcher
        assert exited.global_step == 2, exited  # the last step relayed, since the note was refused
        if why is not None:
            assert why in (exited.detail or ""), exited

    # the NUL and non-UTF-8 lines were dead-lettered; the step after them was relayed all the same
    assert sorted(e.step for e in rig.tap.events(StepMetrics, job_id="spool-nul")) == [1, 2]
    dead = [d for d in rig.tap.events(DeadLetter) if d.source_topic.endswith("/rank-0.jsonl")
            and "spool-nul" in d.source_topic]
    assert len(dead) == 2 and {d.error for d in dead} == {"unreadable spool line (not one JSON object)"}, dead

    # the agent still heartbeats after all of it, and the victim, on the same node, ends ok once released
    beats = len(rig.tap.events(NodeHeartbeat, node_id=NODE))
    await rig.tap.wait(NodeHeartbeat, beats + 2, node_id=NODE, timeout_s=60)
    assert agent.poll() is None, "the node agent survived"
    report("FIFO, /dev/zero and 20 GiB exit notes, poisoned spools", rig.tap, NODE,
           float(rig.agent_settings["heartbeat_s"]))  # type: ignore[arg-type]  # the rig's setting
    assert rig.tap.events(WorkerExited, job_id="victim") == []
    (layout.checkpoints_dir(VICTIM_TENANT, "victim") / "release").write_text("")
    (done,) = await rig.tap.wait(WorkerExited, job_id="victim", timeout_s=60)
    assert (done.exit_code, done.reason) == (0, "ok"), done
    await LeaseManager(rig.redis).release("victim-a1", done.epoch, [Device(NODE, 0)])
