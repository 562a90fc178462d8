"""A Kubernetes cordon is a trainyard drain: the pure decisions of trainyard_node_agent.kube."""

from __future__ import annotations

import pytest

from trainyard_node_agent.kube import KUBERNETES, RESEND_S, cordon_action, due, is_cordoned


@pytest.mark.parametrize(("node", "cordoned"), [
    ({"spec": {}}, False),
    ({}, False),
    ({"spec": {"unschedulable": True}}, True),
    ({"spec": {"unschedulable": False}}, False),
    ({"spec": {"taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}}, True),
    ({"spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}}, False),
])
def test_a_node_is_cordoned_when_unschedulable_or_tainted_so(node: dict, cordoned: bool) -> None:
    assert is_cordoned(node) is cordoned


@pytest.mark.parametrize(("cordoned", "drain", "action"), [
    (True, None, "drain"),  # cordoned, not drained yet (or the drain ended with a restarted agent): drain
    (True, {"by": KUBERNETES}, None),  # already drained: nothing to publish
    (True, {"by": "admin-alice"}, None),  # an admin drained it: still drained
    (False, {"by": KUBERNETES}, "undrain"),  # uncordoned: the drain the cordon started ends
    (False, {"by": "admin-alice"}, None),  # an uncordon never ends an admin's drain
    (False, {"by": "node-agent"}, None),  # nor a stopping agent's
    (False, None, None),
])
def test_the_cordon_drives_the_drain(cordoned: bool, drain: dict | None, action: str | None) -> None:
    assert cordon_action(cordoned, drain) == action


@pytest.mark.parametrize(("action", "sent", "now", "publish"), [
    (None, None, 0.0, False),  # the record agrees with the Node
    ("drain", None, 0.0, True),  # first time
    ("drain", ("drain", 100.0), 100.3, False),  # published a poll ago, the scheduler has not recorded it yet
    ("drain", ("drain", 100.0), 100.0 + RESEND_S, True),  # still not recorded after a while: lost, again
    ("undrain", ("drain", 100.0), 100.3, True),  # the Node changed its mind: the other action at once
])
def test_a_published_action_is_not_repeated_every_poll(action: str | None, sent: tuple | None, now: float,
                                                        publish: bool) -> None:
    assert due(action, sent, now) is publish  # type: ignore[arg-type]
