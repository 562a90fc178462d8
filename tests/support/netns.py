"""Simulated hosts: Linux network namespaces, each with its own address on a private /24, joined by a
bridge in a namespace of their own (the "switch"); this host (the root namespace) is on that switch
too, at ``.1``, where the broker, Redis and the services listen.

::

    root ns  tyr<sfx> 10.231.X.1 ──┐
                                   │  switch ns ty-<sfx>-sw: bridge br0, one port per host
    ty-<sfx>-h0  eth-ty .10 ───────┤
    ty-<sfx>-h1  eth-ty .11 ───────┤
    …                              ┘

The bridge sits in its own namespace, whose (empty) firewall accepts everything, so host↔host traffic
never crosses this host's firewall or needs forwarding; nothing is routed anywhere else: traffic stays
inside the namespaces created here. :meth:`HostNetwork.cut` takes a host's switch port down (its link
is gone: no packets in or out, no resets either, like a pulled cable), :meth:`HostNetwork.restore`
brings it back. Everything is removed by :meth:`HostNetwork.close` (idempotent, also at exit).

Needs root and ``ip`` (iproute2) with netns and veth support: :func:`unavailable` says why not.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

HOST_IFNAME = "eth-ty"  # every host's interface has this name, inside its own namespace


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)  # noqa: S603,S607 - iproute2's ip, test rigs only


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces and veth pairs)"
    if shutil.which("ip") is None:
        return "simulated hosts need iproute2 (`ip`)"
    probe = f"ty-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    try:
        veth = _ip("-n", probe, "link", "add", "tyva", "type", "veth", "peer", "name", "tyvb", check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be made here: {veth.stderr.strip()}"
        bridge = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"bridges cannot be made here: {bridge.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def free_subnet() -> ipaddress.IPv4Network:
    """A 10.231.X.0/24 that no route of this host covers or overlaps."""
    routes = _ip("-4", "route", "show", "table", "all").stdout.split()
    used = []
    for word in routes:
        try:
            used.append(ipaddress.IPv4Network(word, strict=False))
        except ValueError:
            continue
    for x in secrets.SystemRandom().sample(range(256), 256):
        net = ipaddress.IPv4Network(f"10.231.{x}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.231.X.0/24 subnet on this host")


@dataclass(frozen=True)
class SimulatedHost:
    index: int
    netns: str
    address: str
    port: str  # its port on the switch (in the switch namespace)
    ifname: str = HOST_IFNAME

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's network namespace — and only that: ``ip netns exec`` would also give it a
        mount namespace with a fresh /sys, without the host's cgroup hierarchies a sandboxed node agent contains
        its attempts in (a real host has its own /sys/fs/cgroup)."""
        return ["nsenter", f"--net=/var/run/netns/{self.netns}", "--", *argv]


@dataclass
class HostNetwork:
    """``count`` simulated hosts on one switch with this host; :meth:`open` builds it."""

    count: int
    suffix: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: list[SimulatedHost] = field(default_factory=list)
    subnet: ipaddress.IPv4Network | None = None
    _made: list[str] = field(default_factory=list)  # namespaces made, to delete
    _closed: bool = False

    @property
    def switch(self) -> str:
        return f"ty-{self.suffix}-sw"

    @property
    def uplink(self) -> str:
        return f"tyr{self.suffix}"  # this host's end, in the root namespace (15 characters at most)

    @property
    def gateway(self) -> str:
        """This host's address on the switch: where the broker, Redis and the services listen."""
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def open(self) -> HostNetwork:
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        self.subnet = free_subnet()
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", self.switch)
        self._plug("up0")
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.uplink)
        _ip("link", "set", self.uplink, "up")
        for i in range(self.count):
            host = SimulatedHost(i, f"ty-{self.suffix}-h{i}", str(self.subnet.network_address + 10 + i), f"p{i}")
            self._netns(host.netns)
            _ip("link", "add", host.ifname, "netns", host.netns, "type", "veth", "peer", "name", host.port,
                "netns", self.switch)
            self._plug(host.port)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", host.ifname)
            _ip("-n", host.netns, "link", "set", host.ifname, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            self.hosts.append(host)

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _plug(self, port: str) -> None:
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")

    def cut(self, host: SimulatedHost) -> None:
        """Pull the host's cable: its switch port goes down, nothing reaches it or leaves it."""
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def restore(self, host: SimulatedHost) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "up")

    def close(self) -> None:
        """Remove the uplink and every namespace made (their interfaces go with them). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _ip("link", "del", self.uplink, check=False)
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        atexit.unregister(self.close)
