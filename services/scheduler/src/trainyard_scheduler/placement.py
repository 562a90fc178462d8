"""Gang placement over the topology index (:mod:`trainyard_scheduler.topology`): pure, whole gang or nothing.

Rules, in order of importance:

1. every rank gets a healthy, unleased device of ``gpu_type`` (with at least ``min_memory_bytes``)
   on an available node — all ranks or none;
2. a tensor-parallel group never leaves one NVLink domain. When ``tensor`` fits in a node, each
   node's share is a multiple of it (the trainer needs ``LOCAL_WORLD_SIZE % tensor == 0``); a
   larger group may span the nodes of one multi-node domain;
3. locality: the gang goes into the smallest unit that holds it — one domain, else one rack,
   else one tier, else the cluster — and, among the units that do, into the *fullest* one (best
   fit), so that empty racks stay empty for the next big gang;
4. inside the chosen unit, the fewest children: the roomiest children are taken whole and the
   remainder goes to the tightest child that holds it (recursively), so DP replicas spread only
   as far as needed. Ranks are numbered in that order (tensor fastest, then data, then pipeline,
   as the trainer lays them out), so a TP group, a pipeline stage and adjacent stages sit as
   close together as the free devices allow.

Modes (``resources.topology`` of the spec): ``pack`` (default), ``tier`` / ``rack`` / ``domain``
(the whole gang must fit in one such unit, else it waits), ``spread`` / ``spread:N`` (balance the
gang over as many racks as it has TP groups, or at most N racks: bandwidth traded for a smaller
share of the gang per failure domain).

The index is :class:`~trainyard_scheduler.topology.ClusterSnapshot`; ``place`` never mutates it. No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import eq, ne

from trainyard_contract.events import PlacementDetail

from trainyard_scheduler.gang import MODES, GangRequest, NodeShare, Placement, Unschedulable
from trainyard_scheduler.topology import (
    CLUSTER,
    DOMAIN,
    LEVEL_NAMES,
    NODE,
    RACK,
    TIER,
    Aggregates,
    ClusterSnapshot,
)

_MODE_LIMIT = {"pack": CLUSTER, "tier": TIER, "rack": RACK, "domain": DOMAIN}
# Link weights by the widest boundary a link crosses: NVLink, rack switch, tier spine, core.
LINK_WEIGHTS = (1.0, 4.0, 8.0, 16.0)


# ----------------------------------------------------------------------------- placing


def place(snapshot: ClusterSnapshot, request: GangRequest) -> Placement | Unschedulable:
    """Place the whole gang or explain why not (see the module docstring for the rules)."""
    if problem := impossible(snapshot, request):
        return problem
    return place_possible(snapshot, request)


def place_possible(snapshot: ClusterSnapshot, request: GangRequest) -> Placement | Unschedulable:
    """:func:`place` for a request already known not to be :func:`impossible`."""
    tp, need, kind = request.tensor, request.gpu_count, request.gpu_type
    agg = snapshot.aggregates_for(request)
    free = agg.cap[CLUSTER][0]
    if free < need:
        return _short(snapshot, request, agg)
    if request.mode == "spread":
        pieces = _spread(snapshot, agg, need, request.spread)
        if pieces is None:
            return Unschedulable(
                f"waiting for {need} {kind} devices spread over racks in groups of {tp} "
                f"({free} free, but not spreadable that way)", True, "topology")
    else:
        target = smallest_level(snapshot, agg, need)
        limit = _MODE_LIMIT[request.mode]
        if target < limit:
            best = snapshot.best_under(agg, CLUSTER, 0, limit)
            return Unschedulable(
                f"waiting for {need} free {kind} devices inside one {LEVEL_NAMES[limit]} "
                f"(topology {request.mode!r}); the best {LEVEL_NAMES[limit]} has {best} free", True, "topology")
        pieces = []
        fill(snapshot, agg, target, descend(snapshot, agg, target, need), need, pieces)
    return build_placement(snapshot, request, pieces)


def smallest_level(snapshot: ClusterSnapshot, agg: Aggregates, need: int) -> int:
    """The lowest level (domain, rack, tier, else cluster) at which one unit holds ``need`` now."""
    if agg.best_dom[CLUSTER][0] >= need:
        return DOMAIN
    if agg.best_rack[CLUSTER][0] >= need:
        return RACK
    if agg.cap[TIER] and max(agg.cap[TIER]) >= need:
        return TIER
    return CLUSTER


def idle_level(agg: Aggregates, need: int, mode: str) -> int:
    """The level of the unit a gang of ``need`` in ``mode`` would start in were the cluster idle: the smallest that
    holds it (never below what the mode asks for); ``CLUSTER`` for a spread or a gang no smaller unit holds."""
    if mode == "spread":
        return CLUSTER
    limit = _MODE_LIMIT.get(mode, CLUSTER)
    for level, best in ((DOMAIN, agg.idle_best_dom), (RACK, agg.idle_best_rack), (TIER, agg.idle_best_tier)):
        if best >= need:
            return max(level, limit) if limit != CLUSTER else level
    return CLUSTER


def descend(snapshot: ClusterSnapshot, agg: Aggregates, target: int, need: int) -> int:
    """Best fit: at each level, the fullest child that still holds ``need`` in one ``target`` unit."""
    level, i = CLUSTER, 0
    while level < target:
        child_level = level + 1
        caps = agg.cap[child_level]
        pen = snapshot.dom_penalty if child_level == DOMAIN else None
        best, best_key = -1, None
        for c in snapshot.children(level, i):
            if snapshot.best_under(agg, child_level, c, target) < need:
                continue
            # A gang spanning racks goes to the tier where it needs the fewest racks, then best fit.
            spans = _racks_needed(snapshot, agg, c, need) if target == TIER else 0
            nodes = len(snapshot.dom_nodes[c]) if child_level == DOMAIN else 0  # fewer nodes among equals
            key = (pen[c] if pen else 0.0, spans, caps[c], nodes, c)
            if best_key is None or key < best_key:
                best, best_key = c, key
        level, i = child_level, best
    return i


def _racks_needed(snapshot: ClusterSnapshot, agg: Aggregates, tier: int, need: int) -> int:
    """Racks a gang of ``need`` takes in ``tier`` when the roomiest racks go first."""
    rack_cap = agg.cap[RACK]
    count = 0
    for cap in sorted((rack_cap[r] for r in snapshot.tier_racks[tier]), reverse=True):
        if need <= 0:
            break
        need -= cap
        count += 1
    return count


def fill(snapshot: ClusterSnapshot, agg: Aggregates, level: int, i: int, need: int,
         out: list[tuple[int, int]]) -> None:
    """Append ``(node, count)`` pieces taking ``need`` usable devices from unit ``i`` of ``level``."""
    if level == NODE:
        out.append((i, need))
        return
    if level == DOMAIN and agg.pooled[i]:
        _fill_pooled(snapshot, agg, i, need, out)
        return
    child_level = level + 1
    caps = agg.node_u if child_level == NODE else agg.cap[child_level]
    if need >= agg.cap[level][i]:
        _fill_whole(snapshot, agg, level, i, out)
        return
    children = [c for c in snapshot.children(level, i) if caps[c] > 0]
    pen = snapshot.penalty if child_level == NODE else snapshot.dom_penalty if child_level == DOMAIN else None
    pool = sorted(children, key=lambda c: (pen[c] if pen else 0.0, -caps[c], c))
    remaining = need
    left = list(pool)
    for c in pool:
        fitting = [x for x in left if caps[x] >= remaining]
        if fitting:  # the tightest child that holds the rest
            pick = min(fitting, key=lambda x: (pen[x] if pen else 0.0, caps[x], x))
            fill(snapshot, agg, child_level, pick, remaining, out)
            return
        fill(snapshot, agg, child_level, c, caps[c], out)
        remaining -= caps[c]
        left.remove(c)


def _fill_whole(snapshot: ClusterSnapshot, agg: Aggregates, level: int, i: int, out: list[tuple[int, int]]) -> None:
    """Everything usable in the unit, in topology (index) order."""
    doms: list[int] = [i] if level == DOMAIN else []
    if level < DOMAIN:
        racks = [i] if level == RACK else snapshot.tier_racks[i] if level == TIER else range(len(snapshot.rack_names))
        dom_cap = agg.cap[DOMAIN]
        doms = [d for r in racks for d in snapshot.rack_doms[r] if dom_cap[d]]
    node_u = agg.node_u
    for d in doms:
        if agg.pooled[d]:
            _fill_pooled(snapshot, agg, d, agg.cap[DOMAIN][d], out)
        else:
            out.extend((n, node_u[n]) for n in snapshot.dom_nodes[d] if node_u[n])


def _fill_pooled(snapshot: ClusterSnapshot, agg: Aggregates, d: int, need: int, out: list[tuple[int, int]]) -> None:
    """A domain whose TP groups span nodes: fewest nodes, roomiest first."""
    nodes = [n for n in snapshot.dom_nodes[d] if agg.qualifies(snapshot, n)]
    sizes = {n: len(snapshot.free[n].get(agg.kind, ())) for n in nodes}
    remaining = need
    for n in sorted(nodes, key=lambda n: (snapshot.penalty[n], -sizes[n], n)):
        if remaining <= 0:
            break
        take = min(sizes[n], remaining)
        if take:
            out.append((n, take))
            remaining -= take


def _spread(snapshot: ClusterSnapshot, agg: Aggregates, need: int, limit: int) -> list[tuple[int, int]] | None:
    """Balance ``need`` over racks (water-filling in TP groups); None if it cannot be done."""
    tp = agg.tp
    groups = need // tp
    racks = sorted((r for r, c in enumerate(agg.cap[RACK]) if c >= tp), key=lambda r: (-agg.cap[RACK][r], r))
    most = min(limit or groups, groups, len(racks))
    for k in range(max(1, most), len(racks) + 1):
        chosen = sorted(racks[:k], key=lambda r: (agg.cap[RACK][r], r))
        shares: dict[int, int] = {}
        remaining = groups
        for j, r in enumerate(chosen):
            share = min(agg.cap[RACK][r] // tp, math.ceil(remaining / (k - j)))
            shares[r] = share
            remaining -= share
        if remaining == 0:
            pieces: list[tuple[int, int]] = []
            for r in sorted(shares):
                if shares[r]:
                    fill(snapshot, agg, RACK, r, shares[r] * tp, pieces)
            return pieces
        if limit and k >= limit:
            return None
    return None


def build_placement(snapshot: ClusterSnapshot, request: GangRequest, pieces: Sequence[tuple[int, int]]) -> Placement:
    """Number the ranks over the pieces in order; score the result."""
    shares: list[NodeShare] = []
    rank = 0
    kind = request.gpu_type
    for n, count in pieces:
        view = snapshot.view(n)
        shares.append(NodeShare(view.node_id, view.host, rank, tuple(snapshot.free[n][kind][:count])))
        rank += count
    score, detail = describe(snapshot, request, pieces)
    return Placement(tuple(shares), score=score, detail=detail, gpu_type=kind)


def describe(snapshot: ClusterSnapshot, request: GangRequest, pieces: Sequence[tuple[int, int]]
             ) -> tuple[float, PlacementDetail]:
    """Count the gang's links by the widest boundary each crosses; score = links / weighted links.

    Links: TP ring neighbours, DP ring neighbours (same TP index, same pipeline stage) and the
    pairs of adjacent pipeline stages, with ranks numbered tensor-fastest, then data, then pipeline.
    """
    dom, rack, tier = _rank_locations(snapshot, pieces)
    world = len(dom)
    tp = max(1, request.tensor)
    pp = max(1, min(request.pipeline, world // tp or 1))
    stage = max(tp, world // pp)
    counts = _count_links(dom, rack, tier, tp=tp, stage=stage)
    split = sum(map(ne, dom[0::tp], dom[tp - 1::tp])) if tp > 1 else 0
    total = sum(counts)
    weighted = sum(c * w for c, w in zip(counts, LINK_WEIGHTS, strict=True))
    return (round(total / weighted, 4) if weighted else 1.0), _detail(snapshot, request, pieces, counts, split)


def _rank_locations(snapshot: ClusterSnapshot, pieces: Sequence[tuple[int, int]]
                    ) -> tuple[list[int], list[int], list[int]]:
    """Each rank's NVLink domain, rack and network tier, in rank order."""
    dom: list[int] = []
    rack: list[int] = []
    tier: list[int] = []
    node_dom, dom_rack, rack_tier = snapshot.node_dom, snapshot.dom_rack, snapshot.rack_tier
    for n, count in pieces:
        d = node_dom[n]
        r = dom_rack[d]
        dom += [d] * count
        rack += [r] * count
        tier += [rack_tier[r]] * count
    return dom, rack, tier


def _count_links(dom: list[int], rack: list[int], tier: list[int], *, tp: int, stage: int) -> list[int]:
    """The gang's links by the widest boundary each crosses: [in a domain, in a rack, in a tier, across tiers]."""
    world = len(dom)
    counts = [0, 0, 0, 0]

    def links(first: slice, second: slice) -> None:
        """Classify the pairs (first[i], second[i]) at once."""
        total = len(dom[first])
        same_dom = sum(map(eq, dom[first], dom[second]))
        same_rack = sum(map(eq, rack[first], rack[second]))
        same_tier = sum(map(eq, tier[first], tier[second]))
        counts[0] += same_dom
        counts[1] += same_rack - same_dom
        counts[2] += same_tier - same_rack
        counts[3] += total - same_tier

    if tp > 1:  # TP rings
        for j in range(tp - 1):
            links(slice(j, None, tp), slice(j + 1, None, tp))
        if tp > 2:
            links(slice(tp - 1, None, tp), slice(0, None, tp))
    for s in range(0, world, stage):  # DP rings inside each pipeline stage
        size = min(stage, world - s)
        dp = size // tp
        if dp < 2:
            continue
        links(slice(s, s + size - tp), slice(s + tp, s + size))
        if dp > 2:
            links(slice(s + size - tp, s + size), slice(s, s + tp))
    if world > stage:  # adjacent pipeline stages
        links(slice(0, world - stage), slice(stage, world))
    return counts


def _detail(snapshot: ClusterSnapshot, request: GangRequest, pieces: Sequence[tuple[int, int]],
            counts: list[int], split: int) -> PlacementDetail:
    """What the placement spans and crosses, for the job's record."""
    total = sum(counts)
    nodes = {n for n, _ in pieces}
    doms = {snapshot.node_dom[n] for n in nodes}
    racks = {snapshot.dom_rack[d] for d in doms}
    return PlacementDetail(
        mode=request.mode if not request.spread else f"spread:{request.spread}",
        nodes=len(nodes), nvlink_domains=len(doms), racks=len(racks),
        network_tiers=len({snapshot.rack_tier[r] for r in racks}), links=total,
        cross_node_links=total - counts[0], cross_rack_links=counts[2] + counts[3], cross_tier_links=counts[3],
        tp_groups_split=split,
    )


# ----------------------------------------------------------------------------- refusals


def impossible(snapshot: ClusterSnapshot, request: GangRequest) -> Unschedulable | None:
    """Why the gang can never fit this cluster even idle (cached per request shape); None if it could."""
    key = (request.gpu_type, request.gpu_count, request.tensor, request.mode, request.spread,
           request.min_memory_bytes)
    if key not in snapshot.impossible_cache:
        snapshot.impossible_cache[key] = _impossible(snapshot, request)
    return snapshot.impossible_cache[key]


def _impossible(snapshot: ClusterSnapshot, request: GangRequest) -> Unschedulable | None:
    kind, need, tp = request.gpu_type, request.gpu_count, request.tensor
    if request.mode not in MODES:
        return Unschedulable(f"unknown resources.topology {request.mode!r}; use pack, tier, rack, domain, "
                             "spread or spread:N", False, "topology")
    if need % tp:
        return Unschedulable(f"needs {need} devices, which is not a multiple of the tensor-parallel size {tp}",
                             False, "topology")
    whole = snapshot.aggregates(kind, 1)
    healthy = whole.idle[CLUSTER][0]
    if healthy < need:
        holders = sum(1 for n in range(snapshot.node_count())
                      if snapshot.available[n] and snapshot.healthy[n].get(kind))
        if healthy == 0:
            types = ", ".join(snapshot.device_types()) or "none"
            return Unschedulable(f"needs {need} {kind} devices; the cluster has no healthy {kind} devices "
                                 f"({sum(snapshot.available)} available nodes; device types: {types})", False)
        return Unschedulable(f"needs {need} {kind} devices; the cluster has {healthy} healthy {kind} devices "
                             f"on {holders} node{'s' if holders != 1 else ''}", False)
    if request.min_memory_bytes:
        biggest = max((m[kind] for m in snapshot.memory if kind in m), default=0)
        if biggest < request.min_memory_bytes:
            return Unschedulable(
                f"needs {_gib(request.min_memory_bytes)} GiB per device even fully sharded with full "
                f"recomputation; the largest {kind} device has {_gib(biggest)} GiB", False)
    agg = snapshot.aggregates_for(request)
    largest = whole.idle_best_dom
    if tp > largest:
        return Unschedulable(f"a tensor-parallel group of {tp} must stay inside one NVLink domain; the largest "
                             f"{kind} domain has {largest} healthy devices", False, "topology")
    if agg.idle[CLUSTER][0] < need:
        return Unschedulable(
            f"needs {need} {kind} devices in whole tensor-parallel groups of {tp} inside one NVLink domain; "
            f"the cluster offers {agg.idle[CLUSTER][0]} that way", False, "topology")
    limit = _MODE_LIMIT.get(request.mode, CLUSTER)
    best = {DOMAIN: agg.idle_best_dom, RACK: agg.idle_best_rack, TIER: agg.idle_best_tier}.get(limit)
    if best is not None and best < need:
        return Unschedulable(f"needs {need} {kind} devices inside one {LEVEL_NAMES[limit]} (topology "
                             f"{request.mode!r}); the largest has {best}", False, "topology")
    return None


def _short(snapshot: ClusterSnapshot, request: GangRequest, agg: Aggregates) -> Unschedulable:
    kind, need, tp = request.gpu_type, request.gpu_count, request.tensor
    free = snapshot.free_count(kind, 1) if tp > 1 or agg.floor else agg.cap[CLUSTER][0]
    key = (kind, need, tp, agg.floor, agg.cap[CLUSTER][0], free)
    cached = snapshot.shortfall_cache.get(key)
    if cached is None:
        if len(snapshot.shortfall_cache) > 4096:
            snapshot.shortfall_cache.clear()
        cached = snapshot.shortfall_cache[key] = _shortfall(kind, need, tp, free)
    return cached


def _shortfall(kind: str, need: int, tp: int, free: int) -> Unschedulable:
    if free < need or tp == 1:
        return Unschedulable(f"waiting for {need} free {kind} devices ({free} free)")
    return Unschedulable(
        f"waiting for {need} free {kind} devices in whole tensor-parallel groups of {tp} per NVLink domain "
        f"({free} free, but fragmented across nodes)", True, "topology")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"
