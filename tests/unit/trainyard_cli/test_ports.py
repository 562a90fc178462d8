"""Ports the local stack and the tests choose: never one the kernel hands out for outgoing connections."""

from __future__ import annotations

import socket

from trainyard_cli import infra


def test_chosen_ports_lie_below_the_ephemeral_range_and_outside_the_default_rendezvous_range() -> None:
    low, _ = infra._ephemeral_range()
    for _ in range(50):
        first = infra.free_ports(3)
        assert first + 3 <= low
        assert not set(range(first, first + 3)) & set(range(29400, 30000))


def test_a_port_is_never_handed_out_twice_by_one_process() -> None:
    chosen = [infra.free_port() for _ in range(200)]
    assert len(set(chosen)) == len(chosen)


def test_a_port_held_by_a_listener_or_a_connection_is_not_chosen() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.socket() as client:
            client.connect(server.getsockname())
            taken = {server.getsockname()[1], client.getsockname()[1]}
            assert not infra._bindable(server.getsockname()[1], "127.0.0.1")
            assert not infra._bindable(client.getsockname()[1], "127.0.0.1")
            assert not taken & {infra.free_port() for _ in range(100)}
