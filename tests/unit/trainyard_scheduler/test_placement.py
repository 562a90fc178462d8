"""Gang placement, table-driven: whole gang or nothing, TP groups inside one NVLink domain, the
fewest racks, best fit, spread and hard topology modes; and the incremental capacity index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainyard_contract.events import DeviceInfo
from trainyard_scheduler.gang import GangRequest, Placement, Unschedulable, parse_topology
from trainyard_scheduler.placement import place
from trainyard_scheduler.topology import CLUSTER, DOMAIN, RACK, TIER, ClusterSnapshot, NodeView


def node(node_id: str, count: int = 4, *, kind: str = "cpu", leased: tuple[int, ...] = (),
         unhealthy: tuple[int, ...] = (), rack: str | None = None, domain: str | None = None,
         tier: str | None = None, memory: int = 0, penalty: float = 0.0) -> NodeView:
    devices = tuple(DeviceInfo(index=i, type=kind, memory_bytes=memory, healthy=i not in unhealthy)
                    for i in range(count))
    return NodeView(node_id=node_id, host=f"{node_id}.local", devices=devices, leased=frozenset(leased),
                    rack=rack, nvlink_domain=domain, network_tier=tier, penalty=penalty)


def cluster(*nodes: NodeView) -> ClusterSnapshot:
    return ClusterSnapshot(nodes)


def racks(n_racks: int, per_rack: int, *, devices: int = 8, leased: dict[str, tuple[int, ...]] | None = None,
          tiers: int = 1) -> ClusterSnapshot:
    """``n_racks`` racks of ``per_rack`` nodes (r0n0, r0n1, …), racks dealt round-robin over ``tiers``."""
    leased = leased or {}
    return cluster(*(node(f"r{r}n{i}", devices, kind="h100", rack=f"r{r}", tier=f"t{r % tiers}",
                          leased=leased.get(f"r{r}n{i}", ()))
                     for r in range(n_racks) for i in range(per_rack)))


def shares(result: Placement | Unschedulable) -> list[tuple[str, list[int]]]:
    assert isinstance(result, Placement), result
    return [(n.node_id, [r.device_index for r in n.ranks]) for n in result.nodes]


def used_racks(result: Placement | Unschedulable) -> list[str]:
    assert isinstance(result, Placement), result
    return sorted({n.node_id.split("n")[0] for n in result.nodes})


PLACED = [
    # (case, snapshot, request, expected node -> device indices in rank order)
    ("fits one node", cluster(node("a"), node("b")), GangRequest("cpu", 2), [("a", [0, 1])]),
    ("whole node", cluster(node("a"), node("b")), GangRequest("cpu", 4), [("a", [0, 1, 2, 3])]),
    ("needs two nodes", cluster(node("a"), node("b")), GangRequest("cpu", 6), [("a", [0, 1, 2, 3]), ("b", [0, 1])]),
    ("all of the cluster", cluster(node("a"), node("b")), GangRequest("cpu", 8),
     [("a", [0, 1, 2, 3]), ("b", [0, 1, 2, 3])]),
    ("best fit picks the partly used node", cluster(node("a"), node("b", leased=(0, 1))),
     GangRequest("cpu", 2), [("b", [2, 3])]),
    ("tightest node that fits, not the first", cluster(node("a", 8), node("b", 4)),
     GangRequest("cpu", 3), [("b", [0, 1, 2])]),
    ("tail goes to the partly used node, idle node stays whole",
     cluster(node("a"), node("b"), node("c", leased=(0, 1))), GangRequest("cpu", 6),
     [("a", [0, 1, 2, 3]), ("c", [2, 3])]),
    ("skips leased and unhealthy devices", cluster(node("a", leased=(0,), unhealthy=(2,))),
     GangRequest("cpu", 2), [("a", [1, 3])]),
    ("TP groups stay whole per node (the whole cluster, in node order)", cluster(node("a", leased=(0,)), node("b")),
     GangRequest("cpu", 6, tensor=2), [("a", [1, 2]), ("b", [0, 1, 2, 3])]),
    ("only the requested device type", cluster(node("g", kind="h100"), node("c")),
     GangRequest("h100", 4), [("g", [0, 1, 2, 3])]),
    ("one node is preferred to a multi-node NVLink domain of the same room",
     cluster(node("a", 2, domain="nvl"), node("b", 2, domain="nvl"), node("c", 4)),
     GangRequest("cpu", 4, tensor=4), [("c", [0, 1, 2, 3])]),
    ("and does when the domain is the only place", cluster(node("a", 2, domain="nvl"), node("b", 2, domain="nvl"),
                                                           node("c", 4, leased=(0,))),
     GangRequest("cpu", 4, tensor=4), [("a", [0, 1]), ("b", [0, 1])]),
    ("a suspect node (penalty) is used last among equals", cluster(node("a", penalty=1.0), node("b")),
     GangRequest("cpu", 4), [("b", [0, 1, 2, 3])]),
    ("devices too small for the model are skipped",
     cluster(node("small", memory=8 << 30), node("big", memory=80 << 30)),
     GangRequest("cpu", 2, min_memory_bytes=40 << 30), [("big", [0, 1])]),
]


@pytest.mark.parametrize(("case", "snapshot", "request_", "expected"), PLACED, ids=[c[0] for c in PLACED])
def test_places(case: str, snapshot: ClusterSnapshot, request_: GangRequest, expected: list) -> None:
    result = place(snapshot, request_)
    assert shares(result) == expected
    assert isinstance(result, Placement)
    assert [r.rank for n in result.nodes for r in n.ranks] == list(range(request_.gpu_count))
    for share in result.nodes:
        assert [r.local_rank for r in share.ranks] == list(range(len(share.ranks)))
    assert result.master_addr == f"{expected[0][0]}.local"
    assert result.detail is not None and result.detail.tp_groups_split == 0


REFUSED = [
    # (case, snapshot, request, fragment of the reason, fits when idle, kind)
    ("more devices than exist", cluster(node("a"), node("b")), GangRequest("cpu", 16),
     "needs 16 cpu devices; the cluster has 8 healthy cpu devices on 2 nodes", False, "capacity"),
    ("wrong device type", cluster(node("a")), GangRequest("h100", 2),
     "the cluster has no healthy h100 devices (1 available nodes; device types: cpu)", False, "capacity"),
    ("TP group larger than any NVLink domain", cluster(node("a"), node("b")), GangRequest("cpu", 8, tensor=8),
     "a tensor-parallel group of 8 must stay inside one NVLink domain; the largest cpu domain has 4", False,
     "topology"),
    ("TP groups do not tile the nodes", cluster(node("a", 3), node("b", 3)), GangRequest("cpu", 6, tensor=2),
     "in whole tensor-parallel groups of 2 inside one NVLink domain; the cluster offers 4", False, "topology"),
    ("not a multiple of the TP size", cluster(node("a")), GangRequest("cpu", 3, tensor=2),
     "not a multiple of the tensor-parallel size 2", False, "topology"),
    ("not enough free capacity", cluster(node("a", leased=(0, 1, 2)), node("b", leased=(0, 1, 2))),
     GangRequest("cpu", 4), "waiting for 4 free cpu devices (2 free)", True, "capacity"),
    ("free but fragmented", cluster(node("a", leased=(0, 1, 2)), node("b", leased=(0,))),
     GangRequest("cpu", 4, tensor=2), "(4 free, but fragmented across nodes)", True, "topology"),
    ("unhealthy devices do not count", cluster(node("a", unhealthy=(0, 1))), GangRequest("cpu", 4),
     "the cluster has 2 healthy cpu devices on 1 node", False, "capacity"),
    ("no nodes at all", cluster(), GangRequest("cpu", 1), "no healthy cpu devices (0 available nodes", False,
     "capacity"),
    ("no device has the memory", cluster(node("a", memory=8 << 30)), GangRequest("cpu", 1, min_memory_bytes=9 << 30),
     "needs 9.0 GiB per device even fully sharded", False, "capacity"),
    ("one rack is required but none is big enough", racks(2, 2), GangRequest("h100", 24, mode="rack"),
     "needs 24 h100 devices inside one rack (topology 'rack'); the largest has 16", False, "topology"),
    ("one rack is required and none has room now", racks(2, 2, leased={"r0n0": (0,), "r1n0": (0,)}),
     GangRequest("h100", 16, mode="rack"), "inside one rack (topology 'rack'); the best rack has 15 free", True,
     "topology"),
    ("unknown topology", cluster(node("a")), GangRequest("cpu", 1, mode="diagonal"),
     "unknown resources.topology 'diagonal'", False, "topology"),
]


@pytest.mark.parametrize(("case", "snapshot", "request_", "fragment", "idle", "kind"), REFUSED,
                         ids=[c[0] for c in REFUSED])
def test_refuses_with_reason(case: str, snapshot: ClusterSnapshot, request_: GangRequest, fragment: str,
                             idle: bool, kind: str) -> None:
    result = place(snapshot, request_)
    assert isinstance(result, Unschedulable)
    assert fragment in result.reason
    assert result.fits_when_idle is idle
    assert result.kind == kind
    assert result.message == f"{kind}: {result.reason}"


# ----------------------------------------------------------------------------- topology


def test_a_gang_that_fits_one_rack_stays_in_the_fullest_rack_that_holds_it() -> None:
    # r0: 3 nodes free of 4 (24 free); r1: idle (32 free); r2: 1 node free (8)
    snap = racks(3, 4, leased={"r0n0": tuple(range(8)), **{f"r2n{i}": tuple(range(8)) for i in range(3)}})
    result = place(snap, GangRequest("h100", 16, tensor=8))
    assert used_racks(result) == ["r0"]  # r1 stays empty for the next big gang
    assert result.detail.racks == 1 and result.detail.cross_rack_links == 0


def test_a_gang_larger_than_a_rack_takes_the_fewest_racks() -> None:
    snap = racks(4, 4, leased={"r0n0": (0,), "r2n0": (0,), "r2n1": (0,)})
    result = place(snap, GangRequest("h100", 64, tensor=8))  # two whole racks exist: r1, r3
    assert used_racks(result) == ["r1", "r3"]
    d = result.detail
    assert (d.nodes, d.racks, d.nvlink_domains, d.tp_groups_split) == (8, 2, 8, 0)


def test_a_gang_prefers_the_tier_where_it_needs_the_fewest_racks() -> None:
    # t0 = racks 0, 2 (each half used); t1 = racks 1, 3 (idle); 24 devices fit either tier
    snap = racks(4, 2, tiers=2, leased={"r0n0": tuple(range(8)), "r2n0": tuple(range(8))})
    result = place(snap, GangRequest("h100", 16, tensor=8))
    assert len(used_racks(result)) == 1


def test_pipeline_stages_follow_rank_order_and_stay_close() -> None:
    snap = racks(2, 4)
    result = place(snap, GangRequest("h100", 32, tensor=8, pipeline=4))
    assert used_racks(result) == ["r0"]
    ranks = [(r.rank, n.node_id) for n in result.nodes for r in n.ranks]
    stage_nodes = [{node for rank, node in ranks if rank // 8 == s} for s in range(4)]
    assert all(len(nodes) == 1 for nodes in stage_nodes)  # each stage (one TP group) on one node
    assert result.detail.links == 4 * 8 + 3 * 8  # 4 TP rings of 8, 3 stage boundaries x 8 ranks
    assert result.detail.cross_rack_links == 0


def test_spread_balances_the_gang_over_racks() -> None:
    snap = racks(4, 4)
    result = place(snap, GangRequest("h100", 32, tensor=8, mode="spread"))
    assert used_racks(result) == ["r0", "r1", "r2", "r3"]
    limited = place(snap, GangRequest("h100", 32, tensor=8, mode="spread", spread=2))
    assert len(used_racks(limited)) == 2
    assert [len(n.ranks) for n in limited.nodes] == [8, 8, 8, 8]
    assert limited.detail.mode == "spread:2"


def test_score_ranks_placements_of_the_same_shape() -> None:
    one_rack = place(racks(2, 4), GangRequest("h100", 32, tensor=8))
    split = place(racks(2, 4, leased={"r0n0": tuple(range(8)), "r0n1": tuple(range(8)),
                                      "r1n0": tuple(range(8)), "r1n1": tuple(range(8))}),
                  GangRequest("h100", 32, tensor=8))
    assert one_rack.detail.cross_rack_links == 0 and split.detail.cross_rack_links > 0
    assert 0 < split.score < one_rack.score <= 1
    single = place(racks(1, 1), GangRequest("h100", 8, tensor=8))
    assert single.score == 1.0 and single.detail.cross_node_links == 0


@pytest.mark.parametrize(("text", "parsed"), [
    (None, ("pack", 0)), ("pack", ("pack", 0)), ("Rack", ("rack", 0)), ("spread", ("spread", 0)),
    ("spread:3", ("spread", 3)), ("spread:x", ("spread:x", 0)), ("nvlink", ("nvlink", 0)),
])
def test_parse_topology(text: str | None, parsed: tuple[str, int]) -> None:
    assert parse_topology(text) == parsed


# ----------------------------------------------------------------------------- the index


def test_take_and_give_move_devices_in_and_out_of_the_snapshot() -> None:
    snapshot = cluster(node("a"), node("b"))
    first = place(snapshot, GangRequest("cpu", 4))
    after = snapshot.with_leased(first)
    assert snapshot.free_devices("cpu") == 8  # with_leased copies
    second = place(after, GangRequest("cpu", 4))
    assert shares(second) == [("b", [0, 1, 2, 3])]
    after.take(second)
    third = place(after, GangRequest("cpu", 1))
    assert isinstance(third, Unschedulable) and "(0 free)" in third.reason
    after.give(first)
    assert after.free_devices("cpu") == 4
    after.set_available("a", False)
    assert after.free_devices("cpu") == 0 and after.capacity("cpu") == 4
    after.set_available("a", True)
    assert after.free_devices("cpu") == 4


def test_placement_as_event_assignments() -> None:
    result = place(cluster(node("a"), node("b")), GangRequest("cpu", 6))
    assert isinstance(result, Placement)
    nodes = result.assignments()
    assert [n.node_id for n in nodes] == ["a", "b"]
    assert [(r.rank, r.local_rank, r.device_index) for r in nodes[1].ranks] == [(4, 0, 0), (5, 1, 1)]
    assert [str(d) for d in result.devices()][:2] == ["a:0", "a:1"]
    assert result.world_size == 6
    assert 0 < result.score <= 1


def _fresh(snapshot: ClusterSnapshot) -> ClusterSnapshot:
    """The same state rebuilt from scratch (no incremental updates)."""
    views = []
    for n, view in enumerate(snapshot.nodes):
        free = set(snapshot.free[n].get("h100", ()))
        leased = frozenset(d.index for d in view.devices if d.index not in free)
        views.append(NodeView(view.node_id, view.host, view.devices, leased, view.rack, view.nvlink_domain,
                              view.network_tier))
    fresh = ClusterSnapshot(views)
    for n, available in enumerate(snapshot.available):
        if not available:
            fresh.set_available(snapshot.node_id(n), False)
    return fresh


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["place", "give", "fail", "repair"]), st.integers(1, 24),
                          st.sampled_from([1, 2, 4, 8]), st.integers(0, 11)), max_size=30))
def test_incremental_aggregates_match_a_rebuild(ops: list[tuple[str, int, int, int]]) -> None:
    snapshot = cluster(*(node(f"r{r}n{i}", 8, kind="h100", rack=f"r{r}", tier=f"t{r % 2}",
                              domain=f"r{r}d{i // 2}" if r == 2 else None)
                         for r in range(3) for i in range(4)))
    live: list[Placement] = []
    for op, size, tp, pick in ops:
        if op == "place":
            request = GangRequest("h100", size // tp * tp or tp, tp)
            result = place(snapshot, request)
            if isinstance(result, Placement):
                taken = {(d.node_id, d.index) for p in live for d in p.devices()}
                assert not taken & {(d.node_id, d.index) for d in result.devices()}
                snapshot.take(result)
                live.append(result)
        elif op == "give" and live:
            snapshot.give(live.pop(pick % len(live)))
        elif op in ("fail", "repair"):
            snapshot.set_available(snapshot.node_id(pick), op == "repair")
    fresh = _fresh(snapshot)
    for tp in (1, 2, 4, 8):
        a, b = snapshot.aggregates("h100", tp), fresh.aggregates("h100", tp)
        for level in (CLUSTER, TIER, RACK, DOMAIN):
            assert a.cap[level] == b.cap[level], (tp, level)
            assert a.idle[level] == b.idle[level], (tp, level)
        assert a.best_dom == b.best_dom and a.best_rack == b.best_rack
        assert a.node_u == b.node_u
