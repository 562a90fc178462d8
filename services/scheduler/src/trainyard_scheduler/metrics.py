"""Prometheus gauges of the leader's view: queued jobs and how long they waited, nodes by state.

``cluster_view`` is pure (the pass's jobs and nodes in, numbers out); ``publish`` sets the gauges. Labels are
bounded: tenants and a fixed set of node states, never job ids. A standby clears them (``clear``), so only the
leader's numbers are scraped (deploy/prometheus/rules.yml takes the max over instances).

``UNAUTHORISED_EVENTS`` counts, on every instance (each consumes events), the job events its handlers did not take
as they were because the API wrote no matching record (labels: event type and reason, both from fixed sets).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from prometheus_client import Counter, Gauge, Histogram

from trainyard_contract.records import JobRecord, NodeRecord

NODE_STATES: tuple[str, ...] = ("placeable", "out_of_service", "unhealthy", "silent")

PENDING_JOBS = Gauge("trainyard_scheduler_pending_jobs", "jobs queued and holding nothing, by tenant", ["tenant"])
OLDEST_PENDING = Gauge(
    "trainyard_scheduler_oldest_pending_seconds",
    "how long the tenant's longest-waiting pending job has waited (since submission, or since its last attempt "
    "ended)", ["tenant"])
NODES = Gauge(
    "trainyard_scheduler_nodes",
    "nodes in the inventory by state: placeable; out_of_service (live but quarantined or drained); unhealthy "
    "(reported unhealthy); silent (no heartbeat within node_timeout_s: lost)", ["state"])
# Fine buckets around the design's bound (a pass ≤ 100 ms at 4,096 nodes and 10,000 queued jobs, design.md "Scale")
PASS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3,
                0.5, 0.75, 1.0, 2.0, 5.0)
PASS_SECONDS = Histogram(
    "trainyard_scheduler_pass_seconds",
    "the leader's scheduling passes, by phase: reconcile (when due: the repair from durable state), snapshot "
    "(brought up to date), plan (the pure decisions), apply (admissions, preemptions, wait notes written), total",
    ["phase"], buckets=PASS_BUCKETS)
PASS_DECISIONS = Counter("trainyard_scheduler_decisions_total",
                         "decisions of the leader's passes: admit, preempt, wait (one per pending job a pass)",
                         ["kind"])
TAKEOVER_SECONDS = Histogram(
    "trainyard_scheduler_takeover_seconds",
    "a new leader's first pass: from taking the lead to the pass's end (its predecessor's orphans repaired, the "
    "snapshot rebuilt from Redis, the queue planned and applied)", buckets=PASS_BUCKETS)
SNAPSHOT_RELOAD_SECONDS = Histogram(
    "trainyard_scheduler_snapshot_reload_seconds",
    "full reloads of the leader's snapshot (a new leadership, the reconcile's check): every job, node and lease",
    buckets=PASS_BUCKETS)
STRAGGLERS = Counter("trainyard_scheduler_stragglers_total", "StragglerDetected events the scheduler raised")
UNAUTHORISED_EVENTS = Counter(
    "trainyard_scheduler_unauthorised_events_total",
    "JobSubmitted / JobControlRequested events the scheduler did not act on as they were, because the API wrote no "
    "matching record: reason unrecorded (no record: forged, or the record lost), mismatch (the record differs from "
    "the event: the record wins, or the control request is ignored), expired (a control record too old to count). "
    "Anyone with broker access can publish these events; the deploy/prometheus alert "
    "TrainyardUnauthorisedEvents fires on any", ["event", "reason"])
# Every series exists from the start at 0, so that the alert's increase() sees the first refusal (a series born at
# 1 shows no increase).
for _event, _reasons in (("JobSubmitted", ("unrecorded", "mismatch")),
                         ("JobControlRequested", ("unrecorded", "mismatch", "expired"))):
    for _reason in _reasons:
        UNAUTHORISED_EVENTS.labels(_event, _reason)


@dataclass(frozen=True)
class ClusterView:
    pending: Mapping[str, int] = field(default_factory=dict)
    oldest_wait_s: Mapping[str, float] = field(default_factory=dict)
    nodes: Mapping[str, int] = field(default_factory=dict)


def waiting_since(job: JobRecord) -> datetime:
    """When a pending job started waiting: its last attempt's end, else its submission."""
    current = job.current
    return current.ended_at if current is not None and current.ended_at is not None else job.created_at


def cluster_view(pending: Iterable[JobRecord], nodes: Iterable[NodeRecord], *, now: datetime,
                 node_timeout_s: float, live: Iterable[str], placeable: Iterable[str]) -> ClusterView:
    """The numbers of one pass: pending jobs and the oldest wait per tenant, every known node's state."""
    counts: dict[str, int] = {}
    oldest: dict[str, float] = {}
    for job in pending:
        counts[job.tenant] = counts.get(job.tenant, 0) + 1
        waited = max((now - waiting_since(job)).total_seconds(), 0.0)
        oldest[job.tenant] = max(oldest.get(job.tenant, 0.0), waited)
    live_ids, placeable_ids = set(live), set(placeable)
    horizon = now - timedelta(seconds=node_timeout_s)
    states = dict.fromkeys(NODE_STATES, 0)
    for node in nodes:
        if node.node_id in placeable_ids:
            states["placeable"] += 1
        elif node.node_id in live_ids:
            states["out_of_service"] += 1
        elif node.last_seen < horizon:
            states["silent"] += 1
        else:
            states["unhealthy"] += 1
    return ClusterView(pending=counts, oldest_wait_s=oldest, nodes=states)


class ClusterGauges:
    """Sets the gauges from a :class:`ClusterView`; a tenant with nothing pending any more is removed."""

    def __init__(self) -> None:
        self._tenants: set[str] = set()

    def publish(self, view: ClusterView) -> None:
        for tenant in self._tenants - set(view.pending):
            PENDING_JOBS.remove(tenant)
            OLDEST_PENDING.remove(tenant)
        for tenant, count in view.pending.items():
            PENDING_JOBS.labels(tenant).set(count)
            OLDEST_PENDING.labels(tenant).set(view.oldest_wait_s.get(tenant, 0.0))
        self._tenants = set(view.pending)
        for state, count in view.nodes.items():
            NODES.labels(state).set(count)

    def clear(self) -> None:
        """No longer leading: these numbers are another instance's to report."""
        PENDING_JOBS.clear()
        OLDEST_PENDING.clear()
        NODES.clear()
        self._tenants = set()
