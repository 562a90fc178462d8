"""Malicious training scripts that write forged events into their spool, run through the real local
stack (API → scheduler → node agents → the script's ranks; real broker, real Redis).

Each attack must fail and be reported — the job ``failed`` with a ``security:`` reason naming what
was refused, no retry — while another tenant's job running at the same time is unaffected: it is
not cancelled, no forged shard enters its checkpoints, and it succeeds.

Attacks: cancel another tenant's job (JobControlRequested); forge a ShardWritten for another job;
publish a NodeHeartbeat; publish a DatasetVersionPublished; report a shard outside the job's own
checkpoint prefix (by name, and through a symlink); refuse another tenant's READY checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from trainyard_cli.stack import LocalStack

from tests.support.cli import trainyard
from tests.support.stack import running_stack

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]
TERMINAL = {"succeeded", "failed", "cancelled"}
VICTIM_TENANT = "victim"

# What every attack script shares: append one spool line as the SDK would, then wait to be stopped.
PRELUDE = '''
import json, os, sys, time, uuid
from datetime import datetime, timezone

def spool(topic, payload):
    payload = {"eventId": str(uuid.uuid4()), "schemaVersion": 1,
               "occurredAt": datetime.now(timezone.utc).isoformat(), **payload}
    with open(os.environ["TRAINYARD_EVENTS_FILE"], "a") as f:
        f.write(json.dumps({"topic": topic, "key": payload.get("jobId"), "traceparent": None,
                            "payload": payload}) + "\\n")

JOB, TENANT = os.environ["TRAINYARD_JOB_ID"], os.environ["TRAINYARD_TENANT"]
ATTEMPT, EPOCH = int(os.environ["TRAINYARD_ATTEMPT"]), int(os.environ["TRAINYARD_EPOCH"])
ROOT = os.environ["TRAINYARD_ARTIFACT_ROOT"]
VICTIM, VICTIM_TENANT = os.environ["VICTIM_JOB"], os.environ["VICTIM_TENANT"]
SHA = "0" * 64
'''
WAIT = "\ntime.sleep(600)  # the agent stops us long before\n"

ATTACKS: dict[str, tuple[str, str]] = {  # name → (script body, what the refusal says)
    "cancel-another-tenants-job": ('''
spool("trainyard.jobs", {"eventType": "JobControlRequested", "jobId": VICTIM, "tenant": VICTIM_TENANT,
                         "action": "cancel", "reason": "mine now"})
''', "may not publish 'JobControlRequested'"),
    "forge-a-shard-for-another-job": ('''
spool("trainyard.checkpoints", {"eventType": "ShardWritten", "jobId": VICTIM, "tenant": VICTIM_TENANT,
    "attempt": 1, "epoch": 1, "globalStep": 10, "rank": 0, "worldSize": 2,
    "uri": f"file://{ROOT}/tenants/{VICTIM_TENANT}/jobs/{VICTIM}/checkpoints/step-000000010-a1/__0_0.distcp",
    "sizeBytes": 1, "sha256": SHA})
''', "names jobId"),
    "publish-a-heartbeat": ('''
spool("trainyard.nodes", {"eventType": "NodeHeartbeat", "nodeId": "node-0", "host": "evil", "devices": [],
                          "freeDevices": 0})
''', "may not publish 'NodeHeartbeat'"),
    "publish-a-dataset": ('''
spool("trainyard.datasets", {"eventType": "DatasetVersionPublished", "name": "tinycorpus", "version": "v1",
                             "manifestUri": "file:///tmp/evil.json", "sha256": SHA})
''', "may not publish 'DatasetVersionPublished'"),
    "report-a-shard-outside-the-prefix": ('''
spool("trainyard.checkpoints", {"eventType": "ShardWritten", "jobId": JOB, "tenant": TENANT, "attempt": ATTEMPT,
    "epoch": EPOCH, "globalStep": 1, "rank": 0, "worldSize": 1,
    "uri": f"file://{ROOT}/tenants/{VICTIM_TENANT}/jobs/{VICTIM}/checkpoints/x/__0_0.distcp",
    "sizeBytes": 1, "sha256": SHA})
''', "outside the job's checkpoint prefix"),
    "report-a-shard-through-a-symlink": ('''
own = os.path.join(ROOT, "tenants", TENANT, "jobs", JOB, "checkpoints", "step-000000001-a1")
os.makedirs(own, exist_ok=True)
os.symlink("/etc/passwd", os.path.join(own, "__0_0.distcp"))
spool("trainyard.checkpoints", {"eventType": "ShardWritten", "jobId": JOB, "tenant": TENANT, "attempt": ATTEMPT,
    "epoch": EPOCH, "globalStep": 1, "rank": 0, "worldSize": 1, "uri": "file://" + own + "/__0_0.distcp",
    "sizeBytes": 1, "sha256": SHA})
''', "resolves to /etc/passwd"),
    "refuse-another-tenants-checkpoint": ('''
spool("trainyard.checkpoints", {"eventType": "CheckpointRefused", "jobId": JOB, "tenant": TENANT,
    "attempt": ATTEMPT, "globalStep": 20,
    "manifestUri": f"file://{ROOT}/tenants/{VICTIM_TENANT}/jobs/{VICTIM}/checkpoints/step-000000020-a1/manifest.json",
    "problems": ["I say so"]})
''', "neither a checkpoint of this job nor the start checkpoint"),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from running_stack(tmp_path_factory, "security-stack")


def tenant_token(stack: LocalStack, tenant: str) -> str:
    """A token of another tenant (the stack's own token is the dev tenant's)."""
    from trainyard_api.auth import issue_token
    from trainyard_runtime.store import StateStore, connect_redis

    async def issue() -> str:
        redis = connect_redis(stack.redis_url)
        try:
            return await issue_token(StateStore(redis), tenant, name=f"{tenant}-user")
        finally:
            await redis.aclose()

    return asyncio.run(issue())


def submit(stack: LocalStack, token: str, spec: dict[str, Any], code: Path, tmp: Path) -> str:
    spec_file = tmp / f"{spec['name']}.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    done = trainyard(stack, "submit", str(spec_file), "--code", str(code), token=token)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split()[1]
    assert job_id.startswith("job-"), done.stdout
    return job_id


def job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    return client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()


def finished(client: httpx.Client, job_id: str, timeout_s: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = job(client, job_id)
        if last["state"] in TERMINAL:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{job_id}: not finished; last: {json.dumps(last)[:3000]}")


def attack_spec(name: str, victim: str) -> dict[str, Any]:
    return {
        "specVersion": "v1", "name": name, "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1",
        "codeRevision": "attack",
        "code": {"entrypoint": ["python", "attack.py"], "env": {"VICTIM_JOB": victim, "VICTIM_TENANT": VICTIM_TENANT}},
        "resources": {"gpuType": "cpu", "gpuCount": 1}, "parallelism": {"data": 1},
        "checkpointPolicy": {"everySteps": 1000},
        "training": {"seed": 0, "sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 1, "learningRate": 0.01,
                     "maxSteps": 10},
    }


def test_forged_events_fail_their_job_and_leave_another_tenants_job_alone(stack: LocalStack, tmp_path: Path) -> None:
    victim_token = tenant_token(stack, VICTIM_TENANT)
    attacker_token = stack.token_file.read_text().strip()
    victim_spec = yaml.safe_load((REPO / "examples" / "gpt-sdk" / "spec.yaml").read_text())
    victim_spec["name"] = "victim"
    victim_spec["training"]["maxSteps"] = 20  # long enough to run alongside every attack, short for the suite
    victim_spec["checkpointPolicy"]["everySteps"] = 10
    victim = submit(stack, victim_token, victim_spec, REPO / "examples" / "gpt-sdk", tmp_path)

    attacks: dict[str, str] = {}
    for name, (body, _) in ATTACKS.items():
        code = tmp_path / name
        code.mkdir()
        (code / "attack.py").write_text(PRELUDE + textwrap.dedent(body) + WAIT)
        attacks[name] = submit(stack, attacker_token, attack_spec(name, victim), code, tmp_path)

    headers = {"Authorization": f"Bearer {attacker_token}"}
    with httpx.Client(base_url=stack.s.api_url, headers=headers, timeout=30) as client:
        for name, job_id in attacks.items():
            ended = finished(client, job_id)
            why = ATTACKS[name][1]
            assert ended["state"] == "failed", (name, ended)
            reason = ended.get("reason") or ""
            assert reason.startswith("security: ") and why in reason and "not retryable" in reason, (name, reason)
            assert len(ended["attempts"]) == 1, (name, "a security violation is never retried")

    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {victim_token}"},
                      timeout=30) as client:
        ended = finished(client, victim)
        assert ended["state"] == "succeeded", ended
        assert len(ended["attempts"]) == 1, "the victim was never interrupted"
        steps = sorted(c["globalStep"] for c in ended["checkpoints"] if c["state"] == "READY")
        assert steps == [10, 20], ended["checkpoints"]  # its own saves only: the forged shard made none READY
        assert all(c["state"] == "READY" for c in ended["checkpoints"]), "no checkpoint of it was refused"


PROBE_REDIS = '''
import os, sys
import redis

port = int(os.environ["PROBE_PORT"])
leaked = {k: v for k, v in os.environ.items() if "REDIS" in k or "KAFKA" in k or "PASSWORD" in k or "SECRET" in k}
print("ENVIRONMENT", sorted(leaked), flush=True)
urls = [f"redis://127.0.0.1:{port}/0", *[v for v in leaked.values() if v.startswith("redis://")]]
for url in urls:
    try:
        jobs = redis.Redis.from_url(url, socket_timeout=5).zrange("ty:jobs", 0, -1)
    except redis.RedisError as exc:
        print("REFUSED", type(exc).__name__, exc, flush=True)
        continue
    print("ATTACK SUCCEEDED: read", len(jobs), "job ids", flush=True)
    sys.exit(0)
sys.exit(1)
'''


def test_a_training_script_can_neither_find_nor_use_redis_credentials(stack: LocalStack, tmp_path: Path) -> None:
    token = stack.token_file.read_text().strip()
    code = tmp_path / "probe"
    code.mkdir()
    (code / "probe.py").write_text(PROBE_REDIS)
    spec = attack_spec("probe-redis", "none")
    spec["code"] = {"entrypoint": ["python", "probe.py"], "env": {"PROBE_PORT": str(stack.s.redis_port)}}
    job_id = submit(stack, token, spec, code, tmp_path)
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        ended = finished(client, job_id)
    log = (stack.s.artifact_root / "tenants" / ended["tenant"] / "jobs" / job_id / "attempts" / "1" / "logs"
           / "rank-0.log").read_text(errors="replace")
    assert "ATTACK SUCCEEDED" not in log, log
    assert "ENVIRONMENT []" in log, log  # no Redis or broker address, no password in a rank's environment
    # the local stack's node agents refuse ranks' connections to Redis at the network (rank_network: nftables on
    # the job uids); behind that, Redis takes no anonymous client (tests/integration/test_redis_acl.py)
    assert "REFUSED ConnectionError" in log and "Connection refused" in log, log
    assert ended["state"] == "failed", ended


# A real sandboxed rank writes a genuine shard of its own, reports it, and then swaps its step directory for a link
# to a directory it must never reach (another tenant's READY checkpoint, the platform's dataset) — at once, and a
# moment later (while the coordinator verifies and commits). Root (the node agent's relay, the coordinator) must
# never follow it: whichever layer sees the link first refuses it, and nothing is written at the link's target.
SWAP = '''
import hashlib
own = os.path.join(ROOT, "tenants", TENANT, "jobs", JOB, "checkpoints", f"step-000000001-a{ATTEMPT}")
os.makedirs(own, exist_ok=True)
data = os.urandom(4096)
with open(os.path.join(own, "__0_0.distcp"), "wb") as f:
    f.write(data)
spool("trainyard.checkpoints", {"eventType": "ShardWritten", "jobId": JOB, "tenant": TENANT, "attempt": ATTEMPT,
    "epoch": EPOCH, "globalStep": 1, "rank": 0, "worldSize": 1, "uri": "file://" + own + "/__0_0.distcp",
    "sizeBytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
time.sleep(float(os.environ["SWAP_AFTER_S"]))
os.rename(own, own + ".real")
os.symlink(os.environ["SWAP_TO"], own)
print("swapped", own, "->", os.environ["SWAP_TO"], flush=True)
time.sleep(20)
'''


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_rank_that_swaps_its_step_directory_for_a_link_redirects_no_write(stack: LocalStack, tmp_path: Path) -> None:
    victim_token = tenant_token(stack, VICTIM_TENANT)
    attacker_token = stack.token_file.read_text().strip()
    victim_spec = yaml.safe_load((REPO / "examples" / "gpt-sdk" / "spec.yaml").read_text())
    victim_spec["name"] = "swap-victim"
    victim_spec["training"]["maxSteps"] = 20
    victim_spec["checkpointPolicy"]["everySteps"] = 10
    victim = submit(stack, victim_token, victim_spec, REPO / "examples" / "gpt-sdk", tmp_path)
    root = stack.s.artifact_root
    victim_step = root / "tenants" / VICTIM_TENANT / "jobs" / victim / "checkpoints" / "step-000000010-a1"
    dataset = root / "datasets" / "tinycorpus" / "v1"
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {victim_token}"},
                      timeout=30) as client:
        deadline = time.monotonic() + 600
        while not any(c["state"] == "READY" and c["globalStep"] == 10 for c in job(client, victim)["checkpoints"]):
            assert time.monotonic() < deadline and job(client, victim)["state"] not in TERMINAL, job(client, victim)
            time.sleep(0.5)
    before = {"victim": _files(victim_step), "dataset": _files(dataset)}

    attacks = {}
    for name, target, after_s in (("swap-to-victim-now", victim_step, 0.0), ("swap-to-dataset-later", dataset, 0.3)):
        code = tmp_path / name
        code.mkdir()
        (code / "attack.py").write_text(PRELUDE + SWAP)
        spec = attack_spec(name, victim)
        spec["code"]["env"] |= {"SWAP_TO": str(target), "SWAP_AFTER_S": str(after_s)}
        attacks[name] = submit(stack, attacker_token, spec, code, tmp_path)
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {attacker_token}"},
                      timeout=30) as client:
        for name, job_id in attacks.items():
            ended = finished(client, job_id)
            log = (root / "tenants" / ended["tenant"] / "jobs" / job_id / "attempts" / "1" / "logs" / "rank-0.log")
            assert "swapped" in log.read_text(errors="replace"), (name, "the attack ran as written")
            # its step 1 is READY only if it was committed before the swap, in its own (renamed) directory
            for c in ended["checkpoints"]:
                if c["state"] == "READY":
                    assert f"/jobs/{job_id}/checkpoints/" in c["manifestUri"], (name, c)

    assert _files(victim_step) == before["victim"], "nothing was written into the victim's checkpoint"
    assert _files(dataset) == before["dataset"], "nothing was written into the platform's dataset"
    with httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {victim_token}"},
                      timeout=30) as client:
        ended = finished(client, victim)
    assert ended["state"] == "succeeded", ended
    assert sorted(c["globalStep"] for c in ended["checkpoints"] if c["state"] == "READY") == [10, 20]
