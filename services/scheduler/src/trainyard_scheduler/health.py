"""Node health, as pure decisions: straggler detection from per-rank step metrics, and a decaying
failure score per node that quarantines a node and lets it back.

* :class:`StragglerDetector` — per attempt, steps are grouped in windows of ``window_steps``;
  for each window every rank's median ``compute_seconds`` (time before the collective, so the
  wait for a slow peer is not in it) is compared with the median rank's (the lower median, so
  that with two ranks the slow one is compared with the fast one). A rank slower by
  ``factor`` or more for ``consecutive`` windows in a row is a straggler: one
  :class:`Straggler` is reported, and its count starts again (a rank that stays slow is
  reported every ``consecutive`` windows). A window is judged once a step ``lag_steps`` past
  its end has been seen, so ranks reporting a little late still count. Memory: a few windows
  per job, at most ``max_jobs`` jobs (least recently seen dropped).
* Reputation — a node's score halves every ``half_life_s``; an attempt failure attributed to
  the node adds :meth:`ReputationPolicy.weight` of its reason, a straggler report adds
  ``straggler_weight``. At ``quarantine_at`` or more the node is quarantined (no new
  placements) until its decayed score falls under ``reinstate_below`` — :func:`quarantine_until`
  says when, if nothing new happens — or an admin reinstates it. What a rank reports about itself (its
  exit, a signal, a hang, NCCL markers in its log, its step times) is the tenant's code talking: one
  tenant's failures add at most ``per_tenant_cap`` to a node's score within a half-life (:func:`add`), so
  no tenant can quarantine a node alone by failing on purpose; silence of the node (``lost``) is not a
  rank's to forge and is not capped. :func:`quarantine_floor` keeps
  automatic quarantine from taking more than a share of a device type's capacity (and never its
  last node): beyond that the scheduler alerts instead and only an admin quarantines.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from trainyard_contract.errors import ConfigError
from trainyard_contract.events import NodeQuarantined
from trainyard_contract.exitreasons import ExitReason
from trainyard_contract.records import NodeRecord

# ----------------------------------------------------------------------------- stragglers


@dataclass(frozen=True)
class StragglerPolicy:
    window_steps: int = 20
    factor: float = 1.3
    consecutive: int = 3
    lag_steps: int = 2
    min_ranks: int = 2
    max_jobs: int = 10_000

    def __post_init__(self) -> None:
        if self.window_steps < 1 or self.consecutive < 1 or self.factor <= 1.0 or self.min_ranks < 2:
            raise ConfigError("straggler policy: window_steps and consecutive must be >= 1, factor > 1, "
                              f"min_ranks >= 2 (got {self})")


@dataclass(frozen=True)
class Straggler:
    job_id: str
    attempt: int
    rank: int
    slowdown: float
    compute_seconds: float
    median_compute_seconds: float
    window_steps: int
    from_step: int
    to_step: int


@dataclass
class _AttemptWindows:
    attempt: int
    windows: dict[int, dict[int, list[float]]] = field(default_factory=dict)  # window → rank → samples
    streak: dict[int, int] = field(default_factory=dict)  # rank → consecutive slow windows
    judged: int = -1  # highest window judged


class StragglerDetector:
    """Feed it StepMetrics fields with :meth:`observe`; it returns the stragglers it finds."""

    def __init__(self, policy: StragglerPolicy | None = None) -> None:
        self.policy = policy or StragglerPolicy()
        self._jobs: OrderedDict[str, _AttemptWindows] = OrderedDict()

    def observe(self, job_id: str, attempt: int, rank: int, step: int, compute_seconds: float) -> list[Straggler]:
        state = self._state(job_id, attempt)
        if state is None or compute_seconds <= 0 or not math.isfinite(compute_seconds):
            return []
        w = self.policy.window_steps
        window = step // w
        if window > state.judged:
            state.windows.setdefault(window, {}).setdefault(rank, []).append(compute_seconds)
        found: list[Straggler] = []
        for done in sorted(k for k in state.windows if (k + 1) * w + self.policy.lag_steps <= step):
            found += self._judge(job_id, state, done, state.windows.pop(done))
            state.judged = max(state.judged, done)
        return found

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def _state(self, job_id: str, attempt: int) -> _AttemptWindows | None:
        state = self._jobs.get(job_id)
        if state is not None and attempt < state.attempt:
            return None  # a late metric of an older attempt
        if state is None or attempt > state.attempt:
            state = _AttemptWindows(attempt)
            self._jobs[job_id] = state
            while len(self._jobs) > self.policy.max_jobs:
                self._jobs.popitem(last=False)
        self._jobs.move_to_end(job_id)
        return state

    def _judge(self, job_id: str, state: _AttemptWindows, window: int,
               samples: dict[int, list[float]]) -> list[Straggler]:
        if len(samples) < self.policy.min_ranks:
            return []
        per_rank = {rank: statistics.median(values) for rank, values in samples.items()}
        reference = statistics.median_low(per_rank.values())
        if reference <= 0:
            return []
        w = self.policy.window_steps
        found = []
        for rank, value in sorted(per_rank.items()):
            slowdown = value / reference
            if slowdown < self.policy.factor:
                state.streak[rank] = 0
                continue
            state.streak[rank] = state.streak.get(rank, 0) + 1
            if state.streak[rank] >= self.policy.consecutive:
                state.streak[rank] = 0
                first = window - self.policy.consecutive + 1
                found.append(Straggler(job_id, state.attempt, rank, round(slowdown, 3), value, reference,
                                       w * self.policy.consecutive, first * w, (window + 1) * w - 1))
        return found


# ----------------------------------------------------------------------------- reputation

# Failure reasons that say something about the node (not the code, the spec or the data), and their weight:
# declared with each reason (ExitReason.blame_weight); the policy may weigh them otherwise.
NODE_REASONS: dict[str, float] = {r.value: r.blame_weight for r in ExitReason if r.blames_node}


@dataclass(frozen=True)
class ReputationPolicy:
    half_life_s: float = 6 * 3600.0
    quarantine_at: float = 3.0
    reinstate_below: float = 1.0
    straggler_weight: float = 1.0
    weights: dict[str, float] = field(default_factory=lambda: dict(NODE_REASONS))
    # the most one tenant's jobs may add to a node's (decaying) score; None: no cap (a single-tenant cluster)
    per_tenant_cap: float | None = 1.5

    def __post_init__(self) -> None:
        if self.half_life_s <= 0 or not 0 < self.reinstate_below < self.quarantine_at:
            raise ConfigError("reputation policy: half_life_s must be > 0 and 0 < reinstate_below < quarantine_at "
                              f"(got half_life_s={self.half_life_s}, reinstate_below={self.reinstate_below}, "
                              f"quarantine_at={self.quarantine_at})")

    def weight(self, reason: str) -> float:
        """What a failure for ``reason`` adds to the node's score (0: not the node's fault)."""
        return self.weights.get(ExitReason.parse(reason).value, 0.0)

    def tenant_bounded(self, reason: str) -> bool:
        """Whether a failure for ``reason`` could be the tenant's ranks talking (then :func:`add` caps its share);
        a node's silence (``lost``) is not theirs to forge."""
        return ExitReason.parse(reason).tenant_bounded


@dataclass(frozen=True)
class NodeScore:
    score: float
    at: datetime
    tenants: Mapping[str, float] = field(default_factory=dict)  # each tenant's share of ``score`` at ``at``

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"score": self.score, "at": self.at.isoformat()}
        if self.tenants:
            out["tenants"] = dict(self.tenants)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, object]) -> NodeScore:
        tenants: Any = raw.get("tenants") or {}  # JSON: tenant -> share
        return cls(float(raw["score"]), datetime.fromisoformat(str(raw["at"])),  # type: ignore[arg-type]  # JSON numbers
                   {str(k): float(v) for k, v in tenants.items()})


def decayed(score: NodeScore | None, now: datetime, policy: ReputationPolicy) -> float:
    """The score at ``now``: halved every half-life since it was written."""
    if score is None:
        return 0.0
    elapsed = max((now - score.at).total_seconds(), 0.0)
    return score.score * 0.5 ** (elapsed / policy.half_life_s)


def add(score: NodeScore | None, weight: float, now: datetime, policy: ReputationPolicy,
        tenant: str | None = None) -> NodeScore:
    """``score`` decayed to ``now`` plus ``weight`` — for a failure a ``tenant``'s rank reported, only as much as
    keeps that tenant's own (decaying) share at or under ``policy.per_tenant_cap``."""
    factor = 0.5 ** (max((now - score.at).total_seconds(), 0.0) / policy.half_life_s) if score else 1.0
    tenants = {t: share * factor for t, share in (score.tenants if score else {}).items() if share * factor >= 1e-3}
    if tenant is not None and policy.per_tenant_cap is not None:
        weight = max(min(weight, policy.per_tenant_cap - tenants.get(tenant, 0.0)), 0.0)
        tenants[tenant] = tenants.get(tenant, 0.0) + weight
    return NodeScore(decayed(score, now, policy) + weight, now, tenants)


def quarantine_until(score: float, now: datetime, policy: ReputationPolicy) -> datetime:
    """When ``score`` (at ``now``) will have decayed under ``reinstate_below``, if nothing is added."""
    if score < policy.reinstate_below:
        return now
    return now + timedelta(seconds=policy.half_life_s * math.log2(score / policy.reinstate_below))


def should_quarantine(score: float, quarantined: bool, policy: ReputationPolicy) -> bool:
    return not quarantined and score >= policy.quarantine_at


def should_reinstate(score: float, quarantined_by: str | None, policy: ReputationPolicy) -> bool:
    """Only quarantines the reputation made end on their own; an admin's waits for an admin."""
    return quarantined_by == "reputation" and score < policy.reinstate_below


def quarantine_floor(node_id: str, *, capacity: Mapping[str, Mapping[str, int]], out: Collection[str],
                     max_share: float) -> str | None:
    """Why quarantining ``node_id`` automatically would take too much capacity (None: it may be).

    ``capacity``: node → device type → devices, for the nodes of the cluster; ``out``: nodes
    already out of service (quarantined or drained). Automatic quarantine never leaves a device type with no node, and
    never takes more than ``max_share`` of a type's devices; beyond that only an admin quarantines.
    """
    mine = capacity.get(node_id, {})
    gone = set(out) | {node_id}
    for kind, count in sorted(mine.items()):
        if count <= 0:
            continue
        total = sum(c.get(kind, 0) for c in capacity.values())
        taken = sum(capacity[n].get(kind, 0) for n in gone if n in capacity)
        holders = [n for n, c in capacity.items() if c.get(kind, 0) > 0 and n not in gone]
        if not holders:
            return f"it holds the last {kind} devices not quarantined"
        if taken > max_share * total:
            return (f"it would take {taken} of {total} {kind} devices out of service, over the automatic "
                    f"quarantine limit of {max_share:.0%}")
    return None


# ----------------------------------------------------------------------------- saying why a job waits


def live_nodes(records: Iterable[NodeRecord], now: datetime, node_timeout_s: float) -> list[NodeRecord]:
    """Nodes that are healthy and heart-beat within ``node_timeout_s`` of ``now``."""
    horizon = now - timedelta(seconds=node_timeout_s)
    return [n for n in records if n.healthy and n.last_seen >= horizon]


def placeable_nodes(live: Iterable[NodeRecord], *, quarantined: Collection[str],
                    drained: Collection[str]) -> list[NodeRecord]:
    """Of the live nodes, those neither quarantined nor drained."""
    return [n for n in live if not n.quarantined and n.node_id not in quarantined and n.node_id not in drained]


def penalties(reputation: Mapping[str, Mapping[str, float | str]], now: datetime,
              policy: ReputationPolicy) -> dict[str, float]:
    """Each node's decayed failure score (stored JSON dicts), rounded; scores under 0.01 are left out."""
    scores = {n: decayed(NodeScore.from_dict(dict(v)), now, policy) for n, v in reputation.items()}
    return {n: round(v, 3) for n, v in scores.items() if v >= 0.01}


def out_of_service(live: Iterable[NodeRecord], placeable: Collection[str], *, quarantine: Mapping[str, Mapping],
                   drains: Mapping[str, Mapping]) -> list[OutOfService]:
    """Live nodes not placed on (quarantined or drained), for the queued reasons."""
    out = []
    for node in live:
        if node.node_id in placeable:
            continue
        kinds: dict[str, int] = {}
        for d in node.devices:
            if d.healthy:
                kinds[d.type] = kinds.get(d.type, 0) + 1
        q, drain = quarantine.get(node.node_id), drains.get(node.node_id)
        if q is not None:
            until = datetime.fromisoformat(q["until"]) if q.get("until") else None
            out.append(OutOfService(node.node_id, kinds, "quarantined", q.get("reason", ""), q.get("by"), until))
        elif drain is not None:
            out.append(OutOfService(node.node_id, kinds, "drained", drain.get("reason", ""), drain.get("by")))
    return out


@dataclass(frozen=True)
class OutOfService:
    """A live node the scheduler does not place on: quarantined or drained."""

    node_id: str
    devices: Mapping[str, int]  # device type → healthy devices
    why: str  # "quarantined" | "drained"
    reason: str
    by: str | None = None
    until: datetime | None = None

    def describe(self) -> str:
        who = f" by {self.by}" if self.by else ""
        if self.why == "quarantined":
            until = f" until {self.until.isoformat(timespec='seconds')}" if self.until else " until an admin clears it"
            return (f"{self.node_id} quarantined{who} ({self.reason}){until}; reinstate: "
                    f"trainyard admin nodes reinstate {self.node_id}")
        until = " until its node agent restarts" if self.by == "node-agent" else ""
        return (f"{self.node_id} drained{who} ({self.reason}){until}; "
                f"undrain: trainyard admin nodes undrain {self.node_id}")


def explain_wait(reason: str, kind: str | None, *, gpu_type: str, available_devices: int,
                 out: list[OutOfService]) -> tuple[str, str | None]:
    """The queued reason, naming quarantined or drained nodes of ``gpu_type`` when they are why it waits.

    ``available_devices``: healthy ``gpu_type`` devices on placeable nodes. With none, the placement's
    "no healthy devices" would be wrong (they are healthy, just out of service): the reason names the
    nodes, why, until when and the command that brings each back. Otherwise they are added to a
    capacity or topology reason.
    """
    mine = [o for o in out if o.devices.get(gpu_type, 0) > 0]
    if not mine or kind not in (None, "capacity", "topology"):
        return reason, kind
    held = sum(o.devices.get(gpu_type, 0) for o in mine)
    listing = "; ".join(o.describe() for o in mine)
    what = "quarantine" if any(o.why == "quarantined" for o in mine) else "maintenance"
    if available_devices == 0:
        return (f"{what}: every {gpu_type} node is out of service ({held} healthy {gpu_type} devices on "
                f"{len(mine)} node{'s' if len(mine) != 1 else ''}): {listing}", what)
    return f"{reason}; out of service as well ({held} {gpu_type} devices): {listing}", kind


# ----------------------------------------------------------------------------- drains


def drain_change(entry: Mapping[str, object] | None, *, draining: bool, boot_id: str | None,
                 previous_boot_id: str | None) -> str:
    """What a heartbeat does to a node's drain: ``start`` (its agent is stopping), ``end`` (a new incarnation
    of its agent: the node restarted) or ``keep``.

    ``entry``: the drain in force (its ``by`` and the ``bootId`` seen when it began); ``previous_boot_id``:
    the boot id of the node's previous heartbeat (for a drain recorded without one).
    """
    if draining:
        return "start" if entry is None else "keep"
    if entry is None:
        return "keep"
    began = entry.get("bootId") or previous_boot_id
    if boot_id is not None and began is not None and boot_id != began:
        return "end"
    if entry.get("by") == "node-agent" and entry.get("bootId") is None:
        return "end"  # drained by an agent too old to say who it was: any heartbeat not draining ends it
    return "keep"


def quarantine_entry(event: NodeQuarantined) -> dict[str, object]:
    """The ``ty:sched:node-quarantine`` value a quarantine is recorded as (by the reputation or an admin). Pure."""
    return {"reason": event.reason, "by": event.by or "admin", "score": event.score,
            "until": event.until.isoformat() if event.until else None, "at": event.occurred_at.isoformat()}
