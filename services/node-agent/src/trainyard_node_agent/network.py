"""Where this node's ranks talk to their peers: the interface that carries the node's advertised address
(``TRAINYARD_HOST``).

gloo binds to the address this machine's hostname resolves to unless ``GLOO_SOCKET_IFNAME`` names an
interface. That is often not the address peers reach the node at (the hostname resolves to 127.0.0.1
or 127.0.1.1 on many hosts; containers and network namespaces share one hostname): a rank would then
announce a loopback address in the rendezvous store and its peers on other nodes could not connect.
So the ranks get ``GLOO_SOCKET_IFNAME`` = the interface that holds the advertised address, unless the
operator set it (in the agent's environment or ``TRAINYARD_RANK_ENV``).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def interface_for(address: str, interfaces: Mapping[str, str]) -> str | None:
    """The interface (name → its IPv4 address) holding ``address``; None for a loopback or unknown address,
    or a name rather than an address (gloo's own choice then stands). Pure."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_unspecified:
        return None
    return next((name for name, held in sorted(interfaces.items()) if held == str(ip)), None)


def rendezvous_env(base_env: Mapping[str, str], host: str, interfaces: Mapping[str, str],
                   extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base_env`` plus ``GLOO_SOCKET_IFNAME`` for ``host`` (see the module docstring), unless ``base_env``
    or ``extra`` (the operator's rank environment) names one already. Pure."""
    env = dict(base_env)
    if GLOO_IFNAME in env or GLOO_IFNAME in (extra or {}):
        return env
    ifname = interface_for(host, interfaces)
    if ifname is not None:
        env[GLOO_IFNAME] = ifname
    return env


def ipv4_interfaces() -> dict[str, str]:
    """This network namespace's interfaces and their (primary) IPv4 addresses; those without one left out."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address
            found[name] = socket.inet_ntoa(packed[20:24])
    return found
