"""A Kubernetes cordon (what `kubectl drain` does first; DaemonSet pods are not evicted, so the agent
gets no SIGTERM) drains the node in trainyard: the node agent reads its Node object and publishes
NodeDrained, the scheduler places nothing there and says why; an uncordon ends that drain, and an
admin's drain is never ended by one.

The node agent and the scheduler run as real processes against the real broker and Redis. The
Kubernetes API is the one stand-in: no cluster can run here, so a small HTTP server answers
``GET /api/v1/nodes/<name>`` with a Node object (checking the service-account bearer token) the way
the API server does.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_node_agent import Services, reap_ranks, services  # noqa: F401, F811 - fixtures
from tests.integration.test_scheduler_stack import WORKLOAD, EventTap, make_spec, poll
from trainyard_cli import infra
from trainyard_runtime.bus import Bus, ensure_topics
from trainyard_contract.events import GangAllocated, JobSubmitted, NodeDrained, NodeUndrained
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore, connect_redis
from tests.support.datasets import verified

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NODE, KUBE_NODE, TOKEN = "node-k", "gpu-node-17", "sa-token-123"


class NodeApi:
    """The one Node object this test's cluster has, served as the Kubernetes API does."""

    def __init__(self) -> None:
        self.unschedulable = False
        self.reads = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, {"kind": "Status", "code": 401, "message": "Unauthorized"})
                if self.path != f"/api/v1/nodes/{KUBE_NODE}":
                    return self._send(404, {"kind": "Status", "code": 404, "message": "not found"})
                api.reads += 1
                self._send(200, {"kind": "Node", "apiVersion": "v1", "metadata": {"name": KUBE_NODE},
                                 "spec": {"unschedulable": True} if api.unschedulable else {}})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", infra.free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def node_api() -> Iterator[NodeApi]:
    api = NodeApi()
    try:
        yield api
    finally:
        api.close()


async def test_a_cordoned_kubernetes_node_is_drained_until_uncordoned(env: dict[str, Any], services: Services,
                                                                      node_api: NodeApi, tmp_path: Path) -> None:
    await ensure_topics(env["kafka_bootstrap"], partitions=env["topic_partitions"], namespace=env["topic_namespace"])
    tap = EventTap(env["kafka_bootstrap"], env["topic_namespace"])
    publisher = Bus(env["kafka_bootstrap"], service_name="test-publisher", topic_namespace=env["topic_namespace"])
    redis = connect_redis(env["redis_url"])
    store = StateStore(redis)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    await tap.start()
    await publisher.start()

    async def drain() -> dict[str, Any] | None:
        raw = await redis.hget(Keys.node_drain, NODE)
        return json.loads(raw) if raw else None

    try:
        services.start("trainyard_scheduler", "scheduler", tick_s=0.3, reconcile_interval_s=1.0)
        services.start("trainyard_node_agent", "agent", node_id=NODE, device_count=2, heartbeat_s=0.5,
                       rank_command=json.dumps([sys.executable, str(WORKLOAD)]), drain_timeout_s=0,
                       kube_node_name=KUBE_NODE, kube_api_url=node_api.url, kube_token_file=token,
                       kube_ca_file=tmp_path / "no-ca.crt", kube_poll_s=0.3)

        async def registered() -> bool:
            return bool(await redis.hget(Keys.nodes, NODE))

        await poll(registered, f"{NODE} in the inventory; logs:\n{services.log('agent')}", timeout_s=90)

        # 1. kubectl cordon / drain: the agent drains its node; a job that needs it waits and says why
        node_api.unschedulable = True
        entry = await poll(drain, f"the cordon to drain {NODE}; logs:\n{services.log('agent')}", timeout_s=60)
        assert entry["by"] == "kubernetes" and KUBE_NODE in entry["reason"]
        # at least once: one not yet in the drain record is repeated only after kube.RESEND_S
        drained = await tap.wait(NodeDrained, node_id=NODE, timeout_s=60)
        assert drained and {d.by for d in drained} == {"kubernetes"}
        spec = make_spec(2)
        job = JobRecord(job_id="cordoned", tenant="t1", spec=spec, spec_hash=spec.spec_hash())
        await verified(store, spec.dataset)
        assert await store.create_job(job)
        await publisher.publish(JobSubmitted(job_id="cordoned", tenant="t1", spec=spec, spec_hash=spec.spec_hash()))

        async def waiting() -> JobRecord | None:
            j = await store.get_job("cordoned")
            return j if j is not None and j.queued_reason and "drained" in j.queued_reason else None

        queued = await poll(waiting, f"the job waiting for the drained node; logs:\n{services.log('scheduler')}", 60)
        assert NODE in (queued.queued_reason or "") and f"trainyard admin nodes undrain {NODE}" in queued.queued_reason
        assert queued.attempts == [] and queued.queued_reason_kind == "maintenance"

        # 2. kubectl uncordon: the drain the cordon started ends; the job is placed on the node
        node_api.unschedulable = False

        async def undrained() -> bool:
            return await drain() is None

        await poll(undrained, f"the uncordon to end the drain; logs:\n{services.log('agent')}", timeout_s=60)
        ended = await tap.wait(NodeUndrained, node_id=NODE, timeout_s=60)
        assert ended and {e.by for e in ended} == {"kubernetes"}
        (placed,) = await tap.wait(GangAllocated, job_id="cordoned", timeout_s=60)
        assert [n.node_id for n in placed.nodes] == [NODE]

        # 3. an admin's drain of a schedulable node is not the cordon's to end
        await publisher.publish(NodeDrained(node_id=NODE, reason="NIC swap", by="admin-alice"))
        entry = await poll(drain, "the admin's drain recorded", timeout_s=60)
        reads = node_api.reads

        async def polled_again() -> bool:  # the agent has read the (schedulable) Node three more times
            return node_api.reads >= reads + 3

        await poll(polled_again, "the agent to read its Node again", timeout_s=60)
        assert (await drain() or {}).get("by") == "admin-alice"
        assert services.log("agent").count("is schedulable again: its drain ends") == 1
    finally:
        await tap.stop()
        await publisher.aclose()
        await redis.aclose()
