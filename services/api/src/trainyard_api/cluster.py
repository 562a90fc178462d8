"""The cluster view: capacity by device type and the queue for everyone; racks → NVLink domains →
nodes → devices for platform admins.

Pure: :func:`capacity`, :func:`queue`, :func:`topology` over the scheduler's node records, its
quarantine / drain / reputation hashes and the jobs. Which job holds a device comes from the
running attempts' ``devices`` (``node:index``). What a viewer may see: another tenant's queued job
shows with its state, size and reason kind, but neither its id nor its tenant, and a reason text that is
only its kind's general wording (:func:`public_reason`: the scheduler's text names the tenant, its quota,
its cohort and the jobs it waits for); in the viewer's own reasons, a job id that is not the viewer's
reads "another tenant's job" (:func:`redact_job_ids`).
I/O: :class:`ClusterService` loads those from Redis (the newest ``scan_jobs`` jobs, unfinished ones).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from trainyard_contract.events import TERMINAL_STATES
from trainyard_contract.records import JobRecord, NodeRecord
from trainyard_runtime.store import Keys, StateStore

from trainyard_api.schemas import _Out

UNPLACED = "unplaced"
OTHER_JOB = "another tenant's job"
_JOB_ID = re.compile(r"\bjob-[\w-]+")
_PUBLIC_REASONS = {
    "quota": "waiting for its tenant's quota",
    "capacity": "waiting for capacity",
    "topology": "waiting for devices in the shape it needs",
    "priority": "waiting behind jobs ahead in the queue",
    "preemption": "waiting for preempted jobs to stop",
    "backoff": "waiting to retry",
    "quarantine": "waiting for a healthy node",
    "maintenance": "waiting for maintenance to end",
    "interrupted": "waiting to resume after an interruption",
    "checkpoint": "waiting for a checkpoint",
}


class CapacityRow(_Out):
    device_type: str
    total: int
    free: int
    held: int
    quarantined: int
    draining: int


class QueueRow(_Out):
    job_id: str | None = Field(description="null for another tenant's job")
    tenant: str | None = Field(description="null for another tenant's job")
    state: str
    priority: int
    gpu_type: str
    gpu_count: int
    queued_reason: str | None
    queued_reason_kind: str | None
    position: int = Field(description="1 = placed next (priority, then submission order)")


class ClusterView(_Out):
    capacity: list[CapacityRow]
    queue: list[QueueRow]


class DeviceSlot(_Out):
    index: int
    device_type: str
    healthy: bool
    job_id: str | None = Field(description="the job holding the device; null when free (or another tenant's job "
                                           "for a non-admin)")


class TopologyNode(_Out):
    node_id: str
    state: str = Field(description="healthy | unhealthy | quarantined | draining")
    quarantined: bool
    reputation: float | None
    devices: list[DeviceSlot]


class TopologyDomain(_Out):
    domain: str
    nodes: list[TopologyNode]


class TopologyRack(_Out):
    rack: str
    domains: list[TopologyDomain]


class AdminClusterView(_Out):
    racks: list[TopologyRack]


def holders(jobs: Sequence[JobRecord]) -> dict[str, str]:
    """``node:index`` → the job whose running (or starting) attempt holds it."""
    out: dict[str, str] = {}
    for job in jobs:
        current = job.current
        if job.state in TERMINAL_STATES or current is None or current.ended_at is not None:
            continue
        for device in current.devices:
            out[device] = job.job_id
    return out


def _node_state(node: NodeRecord, quarantined: bool, draining: bool) -> str:
    if quarantined:
        return "quarantined"
    if draining:
        return "draining"
    return "healthy" if node.healthy else "unhealthy"


def capacity(nodes: Sequence[NodeRecord], held: Mapping[str, str], quarantined: set[str],
             draining: set[str]) -> list[CapacityRow]:
    """Devices per type: held by a job, on a quarantined or draining node, else free (when healthy)."""
    rows: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(("total", "free", "held", "quarantined",
                                                                         "draining"), 0))
    for node in nodes:
        for d in node.devices:
            row = rows[d.type]
            row["total"] += 1
            if f"{node.node_id}:{d.index}" in held:
                row["held"] += 1
            elif node.node_id in quarantined or node.quarantined:
                row["quarantined"] += 1
            elif node.node_id in draining or node.drained:
                row["draining"] += 1
            elif node.healthy and d.healthy:
                row["free"] += 1
    return [CapacityRow(device_type=t, **r) for t, r in sorted(rows.items())]


def public_reason(job: JobRecord) -> str | None:
    """What another tenant sees of why ``job`` waits: its kind's general wording, never the scheduler's text."""
    if job.queued_reason is None and job.queued_reason_kind is None:
        return None
    return _PUBLIC_REASONS.get(job.queued_reason_kind or "", "waiting")


def redact_job_ids(text: str | None, own: set[str]) -> str | None:
    """``text`` with every job id that is not in ``own`` replaced by "another tenant's job"."""
    if text is None:
        return None
    return _JOB_ID.sub(lambda m: m.group(0) if m.group(0) in own else OTHER_JOB, text)


def queue(jobs: Sequence[JobRecord], viewer_tenant: str | None) -> list[QueueRow]:
    """Queued jobs in placement order; ``viewer_tenant`` None sees every id and reason (a platform admin)."""
    waiting = sorted((j for j in jobs if j.state == "queued"), key=lambda j: (-j.priority, j.created_at))
    mine = {j.job_id for j in jobs if j.tenant == viewer_tenant}
    rows = []
    for position, job in enumerate(waiting, start=1):
        own = viewer_tenant is None or job.tenant == viewer_tenant
        if viewer_tenant is None:
            reason = job.queued_reason
        else:
            reason = redact_job_ids(job.queued_reason, mine) if own else public_reason(job)
        res = job.spec.resources
        rows.append(QueueRow(job_id=job.job_id if own else None, tenant=job.tenant if own else None,
                             state=job.state, priority=job.priority, gpu_type=res.gpu_type, gpu_count=res.gpu_count,
                             queued_reason=reason, queued_reason_kind=job.queued_reason_kind,
                             position=position))
    return rows


def topology(nodes: Sequence[NodeRecord], held: Mapping[str, str], quarantined: set[str], draining: set[str],
             reputation: Mapping[str, float | None]) -> list[TopologyRack]:
    """Racks → NVLink domains → nodes → devices, sorted by name (a node without a rack: ``unplaced``)."""
    tree: dict[str, dict[str, list[TopologyNode]]] = defaultdict(lambda: defaultdict(list))
    for node in sorted(nodes, key=lambda n: n.node_id):
        q = node.node_id in quarantined or node.quarantined is not None
        drain = node.node_id in draining or node.drained is not None
        devices = [DeviceSlot(index=d.index, device_type=d.type, healthy=d.healthy,
                              job_id=held.get(f"{node.node_id}:{d.index}")) for d in node.devices]
        tree[node.rack or UNPLACED][node.nvlink_domain or node.node_id].append(TopologyNode(
            node_id=node.node_id, state=_node_state(node, q, drain), quarantined=q,
            reputation=reputation.get(node.node_id), devices=devices))
    return [TopologyRack(rack=rack, domains=[TopologyDomain(domain=d, nodes=ns) for d, ns in sorted(domains.items())])
            for rack, domains in sorted(tree.items())]


def _score(raw: str | None) -> float | None:
    try:
        value = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return None
    score = value.get("score") if isinstance(value, dict) else None
    return float(score) if isinstance(score, int | float) else None


class ClusterService:
    def __init__(self, store: StateStore, *, scan_jobs: int = 5000) -> None:
        self.store = store
        self.redis = store.redis
        self.scan_jobs = scan_jobs

    async def _load(self) -> tuple[list[NodeRecord], list[JobRecord], set[str], set[str], dict[str, Any]]:
        nodes = await self.store.list_nodes()
        ids = await self.store.list_job_ids(limit=self.scan_jobs)
        jobs = [j for j in await self.store.get_jobs(ids) if j.state not in TERMINAL_STATES]
        quarantined: set[str] = set(await self.redis.hkeys(Keys.node_quarantine))  # type: ignore[arg-type]  # decoded
        draining: set[str] = set(await self.redis.hkeys(Keys.node_drain))  # type: ignore[arg-type]  # decoded
        scores: dict[str, str] = await self.redis.hgetall(Keys.node_reputation)  # type: ignore[assignment]  # decoded
        reputation = {k: _score(v) for k, v in scores.items()}
        return nodes, jobs, quarantined, draining, reputation

    async def view(self, viewer_tenant: str | None) -> ClusterView:
        nodes, jobs, quarantined, draining, _ = await self._load()
        return ClusterView(capacity=capacity(nodes, holders(jobs), quarantined, draining),
                           queue=queue(jobs, viewer_tenant))

    async def admin_view(self) -> AdminClusterView:
        nodes, jobs, quarantined, draining, reputation = await self._load()
        return AdminClusterView(racks=topology(nodes, holders(jobs), quarantined, draining, reputation))
