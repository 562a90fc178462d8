"""A stand-in for a trainer rank, for the scheduler and node-agent integration tests.

Standard library only (starts in milliseconds). It checks nothing itself: it prints the rank
environment to its log (the tests read it back), writes one StepMetrics line to its event
spool the way ``SpoolWriter`` does, sleeps, and exits with a code. Behaviour per job comes
from ``workload.json`` in the job's dataset directory (``$TRAINYARD_ARTIFACT_ROOT/datasets/<name>/<version>``:
a sandboxed rank sees its dataset, read-only, and nothing else of the artifact root's top level)::

    {"<job id>": {"sleep": {"<attempt>": {"<rank>": seconds}}, "exit": {"<attempt>": {"<rank>": code}}}}
"""

from __future__ import annotations

import json
import os
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
    time.sleep(lookup(control.get("sleep", {}), attempt, rank, 0.0))
    code = int(lookup(control.get("exit", {}), attempt, rank, 0))
    print(f"rank {rank} of attempt {attempt} exits with {code}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
