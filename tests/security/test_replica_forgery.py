"""A ReplicaReplaced is not an authority (``faultTolerance``): one written straight to the broker by someone who
reaches it starts nothing, on the real local stack (API → scheduler → node agents → ranks joined by torchft).

Against a running fault-tolerant job:

* a ReplicaReplaced the scheduler never decided (no ``ty:replica`` grant), for a rank that runs: refused;
* one naming another epoch or attempt of the allocation, or another job's allocation: refused;
* one for an allocation that is not fault-tolerant (a plain job of another tenant running beside it): refused;
* after a genuine replacement (a rank killed -9, started again as generation 1), the genuine event replayed:
  nothing starts a second time.

Each refusal is in the node's recent refusals (``ty:agent:<node>:refused``) with what it lacked; the job goes on
in one attempt, with exactly the one genuine replacement, and succeeds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.test_user_code import finished, rank_pids, submit, wait_for
from tests.support.stack import api_client, rank_entries, running_stack
from trainyard_cli.stack import LocalStack
from trainyard_contract import events as ev

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.security, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from running_stack(tmp_path_factory, "replica-forgery")


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> Iterator[httpx.Client]:
    yield from api_client(stack)


def publish(stack: LocalStack, *events: ev.Event) -> None:
    """Straight to the broker, as anyone who reaches it could."""
    from aiokafka import AIOKafkaProducer

    async def send() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=stack.kafka_bootstrap)
        await producer.start()
        try:
            for event in events:
                await producer.send_and_wait(stack.s.topic_namespace + event.topic, event.to_bytes(),
                                             key=event.key().encode())
        finally:
            await producer.stop()

    asyncio.run(send())


def refusals(stack: LocalStack) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        return [json.loads(raw) for node in range(stack.s.nodes)
                for raw in client.lrange(f"ty:agent:node-{node}:refused", 0, -1)]
    finally:
        client.close()


def replaced(j: dict[str, Any], rank: int, generation: int, *, node: str, epoch: int | None = None,
             attempt: int | None = None) -> ev.ReplicaReplaced:
    a = j["attempts"][-1]
    return ev.ReplicaReplaced(job_id=j["jobId"], attempt=attempt or a["attempt"], allocation_id=a["allocationId"],
                              epoch=epoch or a["epoch"], node_id=node, rank=rank, generation=generation,
                              reason="killed")


def node_of(stack: LocalStack, job_id: str, rank: int) -> str:
    """The node whose agent runs the rank (its rank table in Redis)."""
    nodes = [node for node, e in rank_entries(stack, job_id) if int(e["rank"]) == rank]
    assert nodes, f"rank {rank} of {job_id} runs nowhere"
    return nodes[0]


def test_forged_replacements_start_nothing(stack: LocalStack, client: httpx.Client, tmp_path: Path) -> None:
    victim = submit(stack, tmp_path, "fault-tolerant", name="ft-victim", training__maxSteps=600,
                    checkpointPolicy__everySteps=100, code__env={"EXAMPLE_STEP_PAUSE_SECONDS": "0.04"})
    plain = submit(stack, tmp_path, "gpt-sdk", name="plain-neighbour", training__maxSteps=200)
    j = wait_for(client, victim, "steps", lambda j: j if j["state"] == "running"
                 and (j.get("progress") or {}).get("globalStep", 0) >= 10 else None)
    p = wait_for(client, plain, "running", lambda j: j if j["state"] == "running" else None)
    pids = wait_for(client, victim, "rank pids", lambda _: (x := rank_pids(stack, victim, 1)) and len(x) == 2 and x)
    rank1_node = node_of(stack, victim, 1)

    before = len(refusals(stack))
    publish(stack,
            replaced(j, 1, 1, node=rank1_node),                                      # no grant
            replaced(j, 1, 1, epoch=j["attempts"][-1]["epoch"] + 7, node=rank1_node),  # another epoch
            replaced(j, 1, 1, attempt=2, node=rank1_node),                            # another attempt
            replaced(p, 0, 1, node=node_of(stack, plain, 0)))                          # not fault-tolerant
    said = wait_for(client, victim, "four refusals",
                    lambda _: (r := refusals(stack)) and len(r) >= before + 4 and r)
    reasons = " | ".join(r["reason"] for r in said)
    assert "granted rank 1 generation none, not 1" in reasons, reasons
    assert "not a fault-tolerant allocation launched on this node" in reasons, reasons
    assert reasons.count("replica replacement refused") >= 4, reasons
    assert rank_pids(stack, victim, 1) == pids  # the same two processes: nothing started, nothing stopped

    # a genuine replacement, then the genuine event replayed: started once
    os.kill(pids[1], signal.SIGKILL)
    j = wait_for(client, victim, "the newcomer", lambda j: (a := j["attempts"][-1]).get("replacements")
                 and a["replacements"][0]["startedAt"] and j)
    newcomer = wait_for(client, victim, "its pid", lambda _: (x := rank_pids(stack, victim, 1)).get(1) != pids[1]
                        and 1 in x and x)
    publish(stack, replaced(j, 1, 1, node=rank1_node))
    wait_for(client, victim, "ten more steps", lambda k: (k.get("progress") or {}).get("globalStep", 0)
             >= (j.get("progress") or {}).get("globalStep", 0) + 10 and k)
    assert rank_pids(stack, victim, 1)[1] == newcomer[1]

    done, neighbour = finished(client, victim), finished(client, plain)
    assert done["state"] == "succeeded" and neighbour["state"] == "succeeded", json.dumps(done)[:3000]
    (attempt,) = done["attempts"]
    assert attempt["generations"] == {"1": 1} and len(attempt["replacements"]) == 1, attempt
    assert len(neighbour["attempts"]) == 1
