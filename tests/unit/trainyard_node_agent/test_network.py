"""Ranks bind gloo to the interface of the node's advertised address (trainyard_node_agent.network)."""

from __future__ import annotations

import pytest

from trainyard_node_agent.network import GLOO_IFNAME, interface_for, ipv4_interfaces, rendezvous_env

INTERFACES = {"lo": "127.0.0.1", "eth0": "192.0.2.2", "eth-ty": "10.231.7.10"}


@pytest.mark.parametrize(("host", "expected"), [
    ("10.231.7.10", "eth-ty"),
    ("192.0.2.2", "eth0"),
    ("127.0.0.1", None),  # loopback: a single host; gloo's own choice stands
    ("0.0.0.0", None),
    ("198.51.100.9", None),  # not an address of this node (behind NAT, a proxy): nothing to pin
    ("node-3.cluster.local", None),  # a name: gloo resolves it itself
    ("::1", None),
])
def test_interface_for(host: str, expected: str | None) -> None:
    assert interface_for(host, INTERFACES) == expected


def test_rendezvous_env_adds_the_interface_of_the_advertised_address() -> None:
    base = {"PATH": "/bin"}
    assert rendezvous_env(base, "10.231.7.10", INTERFACES) == {"PATH": "/bin", GLOO_IFNAME: "eth-ty"}
    assert base == {"PATH": "/bin"}  # not changed in place


@pytest.mark.parametrize("where", ["agent", "rank_env"])
def test_rendezvous_env_keeps_the_operators_choice(where: str) -> None:
    base = {GLOO_IFNAME: "bond0"} if where == "agent" else {}
    extra = {GLOO_IFNAME: "bond0"} if where == "rank_env" else None
    assert rendezvous_env(base, "10.231.7.10", INTERFACES, extra=extra) == base


def test_rendezvous_env_leaves_a_loopback_node_alone() -> None:
    assert rendezvous_env({}, "127.0.0.1", INTERFACES) == {}


def test_ipv4_interfaces_finds_loopback() -> None:
    assert ipv4_interfaces().get("lo") == "127.0.0.1"
