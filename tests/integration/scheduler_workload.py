"""A stand-in for a trainer rank, for the scheduler and node-agent integration tests.

Standard library only (starts in milliseconds). It checks nothing itself: it prints the rank
environment to its log (the tests read it back), writes one StepMetrics line to its event
spool the way ``SpoolWriter`` does, sleeps, and exits with a code. Behaviour per job comes
from ``workload.json`` in the job's dataset directory (``$TRAINYARD_ARTIFACT_ROOT/datasets/<name>/<version>``:
a sandboxed rank sees its dataset, read-only, and nothing else of the artifact root's top level)::

    {"<job id>": {"sleep": {"<attempt>": {"<rank>": seconds}}, "exit": {"<attempt>": {"<rank>": code}},
                  "onRequest": {"<attempt>": {"step": n, "release": "<file name>"}}}}

``onRequest`` (opt-in): asked to checkpoint and stop (SIGUSR1 from the agent, or its request file), the rank
does what the SDK does — it "saves" step ``n`` and exits 7, its exit note naming that step — but only once
the file ``release`` exists beside the control file (when named): the test decides when the ranks answer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TRAINYARD_BACKEND", "TRAINYARD_DEVICE_INDEX", "TRAINYARD_JOB_ID", "TRAINYARD_TENANT",
            "TRAINYARD_ATTEMPT", "TRAINYARD_EPOCH", "TRAINYARD_ALLOCATION_ID", "TRAINYARD_ARTIFACT_ROOT",
            "TRAINYARD_ALLOCATION_FILE", "TRAINYARD_EVENTS_FILE", "TRACEPARENT")


CONTROL_FILE = "workload.json"


def control_file_for(artifact_root: Path, dataset: str = "tinycorpus@v1") -> Path:
    """Where a test writes the workload's behaviour: in the dataset its jobs name (make_spec's by default)."""
    name, _, version = dataset.partition("@")
    return Path(artifact_root, "datasets", name, version, CONTROL_FILE)


def lookup(table: dict, attempt: int, rank: int, default: float) -> float:
    return table.get(str(attempt), {}).get(str(rank), default)


def answer_request(answer: dict, control_dir: Path, seconds: float) -> bool:
    """Sleep ``seconds`` unless asked to checkpoint and stop; asked (and released), write the exit note
    the SDK writes for step ``answer["step"]`` and say so (the caller exits 7)."""
    asked: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: asked.append(signum))
    request_file = os.environ.get("TRAINYARD_CHECKPOINT_REQUEST_FILE")
    release = control_dir / answer["release"] if answer.get("release") else None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        requested = bool(asked) or bool(request_file and Path(request_file).exists())
        if requested and (release is None or release.exists()):
            note = {"exitCode": 7, "reason": "preempted", "globalStep": int(answer["step"]), "error": None}
            Path(os.environ["TRAINYARD_EXIT_NOTE_FILE"]).write_text(json.dumps(note))
            print(f"checkpoint requested: saved step {answer['step']}, exits 7", flush=True)
            return True
        time.sleep(0.05)
    return False


def main() -> int:
    env = os.environ
    allocation = json.loads(Path(env["TRAINYARD_ALLOCATION_FILE"]).read_text())
    job_id, rank, attempt = allocation["jobId"], int(env["RANK"]), int(env["TRAINYARD_ATTEMPT"])
    name, _, version = allocation["spec"]["dataset"].partition("@")
    control_file = Path(env["TRAINYARD_ARTIFACT_ROOT"], "datasets", name, version, CONTROL_FILE)
    control = json.loads(control_file.read_text()).get(job_id, {}) if control_file.exists() else {}
    print("ENV " + json.dumps({k: env.get(k) for k in CONTRACT}, sort_keys=True), flush=True)
    payload = {
        "eventId": str(uuid.uuid4()), "eventType": "StepMetrics", "schemaVersion": 1,
        "occurredAt": datetime.now(UTC).isoformat(), "jobId": job_id, "tenant": allocation["tenant"],
        "attempt": attempt, "rank": rank, "step": allocation["spec"]["training"]["maxSteps"], "loss": 1.5,
        "consumedTokens": 0,
    }
    line = {"topic": "trainyard.metrics", "key": job_id, "traceparent": env.get("TRACEPARENT"), "payload": payload}
    with open(env["TRAINYARD_EVENTS_FILE"], "a", encoding="utf-8") as spool:
        spool.write(json.dumps(line, separators=(",", ":")) + "\n")
        spool.flush()
        os.fsync(spool.fileno())
    seconds = lookup(control.get("sleep", {}), attempt, rank, 0.0)
    answer = control.get("onRequest", {}).get(str(attempt))
    if answer is not None and answer_request(answer, control_file.parent, seconds):
        return 7
    time.sleep(seconds)
    code = int(lookup(control.get("exit", {}), attempt, rank, 0))
    print(f"rank {rank} of attempt {attempt} exits with {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
