"""The rendezvous port of a new attempt (``GangAllocated.master_port``): drawn at random from
``[rendezvous_port_min, rendezvous_port_max]``, never one a live attempt the scheduler knows holds. Pure.

A counter made the next port predictable: a process that outlived its job could listen on the ports
coming up and fail the next jobs' rendezvous (EADDRINUSE), or take their ranks' TCPStore handshakes.
Drawn at random, the port cannot be guessed; the node agent that launches rank 0 checks that it is free
on its host before starting anything (``trainyard_node_agent.rank_network.port_in_use``), and a taken
one fails only that attempt, retried on another draw. The shell draws with :data:`SYSTEM_RANDOM`
(the OS's randomness: a Mersenne Twister's next output can be predicted from ones it gave out)."""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable

from trainyard_contract.records import JobRecord

from trainyard_scheduler.transitions import is_live

SYSTEM_RANDOM = random.SystemRandom()


def choose_port(rng: random.Random, low: int, high: int, taken: Collection[int] = ()) -> int:
    """A port of ``[low, high]`` drawn with ``rng``, not in ``taken`` while any other is left (when every port
    is taken, any: the agent's check then decides)."""
    if low > high:
        raise ValueError(f"empty port range {low}-{high}")
    taken = set(taken)
    free = high - low + 1 - sum(1 for p in taken if low <= p <= high)
    if free <= 0:
        return rng.randint(low, high)
    pick = rng.randrange(free)  # the pick-th free port, counted from low: one draw, uniform over the free ones
    for port in range(low, high + 1):
        if port in taken:
            continue
        if pick == 0:
            return port
        pick -= 1
    raise AssertionError("unreachable: fewer free ports than counted")


def live_ports(jobs: Iterable[JobRecord]) -> set[int]:
    """The master ports (and Lighthouse ports) of the live (starting or running) attempts of ``jobs``."""
    live = [j.current for j in jobs if j.current is not None and is_live(j.current)]
    return {p for a in live for p in (a.master_port, a.lighthouse_port) if p is not None}
