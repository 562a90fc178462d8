"""Gang placement, table-driven: whole gang or nothing, TP groups inside a node, best fit."""

from __future__ import annotations

import pytest

from trainyard_common.events import DeviceInfo
from trainyard_scheduler.placement import ClusterSnapshot, GangRequest, NodeView, Placement, Unschedulable, place


def node(node_id: str, count: int = 4, *, kind: str = "cpu", leased: tuple[int, ...] = (),
         unhealthy: tuple[int, ...] = ()) -> NodeView:
    devices = tuple(DeviceInfo(index=i, type=kind, memory_bytes=0, healthy=i not in unhealthy) for i in range(count))
    return NodeView(node_id=node_id, host=f"{node_id}.local", devices=devices, leased=frozenset(leased))


def cluster(*nodes: NodeView) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(nodes))


def shares(result: Placement | Unschedulable) -> list[tuple[str, list[int]]]:
    assert isinstance(result, Placement), result
    return [(n.node_id, [r.device_index for r in n.ranks]) for n in result.nodes]


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
    ("TP groups stay whole per node", cluster(node("a", leased=(0,)), node("b")),
     GangRequest("cpu", 6, tensor=2), [("b", [0, 1, 2, 3]), ("a", [1, 2])]),
    ("only the requested device type", cluster(node("g", kind="h100"), node("c")),
     GangRequest("h100", 4), [("g", [0, 1, 2, 3])]),
]


@pytest.mark.parametrize(("case", "snapshot", "request_", "expected"), PLACED, ids=[c[0] for c in PLACED])
def test_places(case: str, snapshot: ClusterSnapshot, request_: GangRequest, expected: list) -> None:
    result = place(snapshot, request_)
    assert shares(result) == expected
    assert isinstance(result, Placement)
    assert [r.rank for n in result.nodes for r in n.ranks] == list(range(request_.gpu_count))
    for share in result.nodes:
        assert [r.local_rank for r in share.ranks] == list(range(len(share.ranks)))
        assert len(share.ranks) % request_.tensor == 0
    assert result.master_addr == f"{expected[0][0]}.local"


REFUSED = [
    # (case, snapshot, request, fragment of the reason, fits when idle)
    ("more devices than exist", cluster(node("a"), node("b")), GangRequest("cpu", 16),
     "needs 16 cpu devices; the cluster has 8 healthy cpu devices on 2 nodes", False),
    ("wrong device type", cluster(node("a")), GangRequest("h100", 2),
     "the cluster has no healthy h100 devices (1 available nodes; device types: cpu)", False),
    ("TP group would cross a node", cluster(node("a"), node("b")), GangRequest("cpu", 8, tensor=8),
     "a tensor-parallel group of 8 must stay inside one node; the largest cpu node has 4", False),
    ("TP groups do not tile the nodes", cluster(node("a", 3), node("b", 3)), GangRequest("cpu", 6, tensor=2),
     "in whole tensor-parallel groups of 2 per node; the cluster offers 4", False),
    ("not enough free capacity", cluster(node("a", leased=(0, 1, 2)), node("b", leased=(0, 1, 2))),
     GangRequest("cpu", 4), "waiting for 4 free cpu devices (2 free)", True),
    ("free but fragmented", cluster(node("a", leased=(0, 1, 2)), node("b", leased=(0,))),
     GangRequest("cpu", 4, tensor=2), "(4 free, but fragmented across nodes)", True),
    ("unhealthy devices do not count", cluster(node("a", unhealthy=(0, 1))), GangRequest("cpu", 4),
     "the cluster has 2 healthy cpu devices on 1 node", False),
    ("no nodes at all", cluster(), GangRequest("cpu", 1), "no healthy cpu devices (0 available nodes", False),
]


@pytest.mark.parametrize(("case", "snapshot", "request_", "fragment", "idle"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refuses_with_reason(case: str, snapshot: ClusterSnapshot, request_: GangRequest, fragment: str,
                             idle: bool) -> None:
    result = place(snapshot, request_)
    assert isinstance(result, Unschedulable)
    assert fragment in result.reason
    assert result.fits_when_idle is idle


def test_with_leased_takes_the_placement_out_of_the_snapshot() -> None:
    snapshot = cluster(node("a"), node("b"))
    first = place(snapshot, GangRequest("cpu", 4))
    assert isinstance(first, Placement)
    after = snapshot.with_leased(first)
    second = place(after, GangRequest("cpu", 4))
    assert shares(second) == [("b", [0, 1, 2, 3])]
    third = place(after.with_leased(second), GangRequest("cpu", 1))
    assert isinstance(third, Unschedulable) and "(0 free)" in third.reason


def test_placement_as_event_assignments() -> None:
    result = place(cluster(node("a"), node("b")), GangRequest("cpu", 6))
    assert isinstance(result, Placement)
    nodes = result.assignments()
    assert [n.node_id for n in nodes] == ["a", "b"]
    assert [(r.rank, r.local_rank, r.device_index) for r in nodes[1].ranks] == [(4, 0, 0), (5, 1, 1)]
    assert [str(d) for d in result.devices()][:2] == ["a:0", "a:1"]
    assert result.world_size == 6
    assert 0 < result.score <= 1
