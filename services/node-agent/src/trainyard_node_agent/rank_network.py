"""What a sandboxed rank may not reach on the network: the control plane (the broker, Redis and its Sentinels,
the API, the services' metrics ports, the OTLP collector, Prometheus, an S3 endpoint), refused by nftables rules
that match the socket owner's uid against the job uid range of :mod:`sandbox`. The agent (root) and every other
user of the host still reach all of it; ranks still reach each other (rendezvous, gloo, NCCL), the datasets and
whatever else is not listed.

``TRAINYARD_NODE_RANK_BLOCKED`` (``settings.node_rank_blocked``) lists the endpoints, ``host:port`` each
(:func:`parse_entries`): a loopback host (``localhost``, ``127.0.0.1``, ``::1``) or a wildcard one (``0.0.0.0``,
``::``) stands for *this node, whichever of its addresses* (a service listening on 0.0.0.0 is also reachable at
the node's other addresses: ``fib daddr type local``), ``*`` for any destination, an address or a CIDR for
itself, a name for the addresses it resolves to at start-up; a port may be a range ``lo-hi``. The agent's own
metrics port is added. New TCP connections are reset and UDP answered port-unreachable (``ct state new``: the
replies of a connection a peer opened to a rank are never matched, whatever their port).

The rules are one table per agent, ``inet trainyard_<node id>_<hash>`` (:func:`table_name`), rendered by
:func:`render` (pure) and applied at start-up with ``nft -f -`` as one transaction that replaces a stale table of
the same name (:class:`RankNetwork`); they are deleted when the agent closes after stopping its ranks (an agent
that leaves its ranks running for the next one to adopt leaves the rules too; the next one replaces them).

Why owner rules rather than a network namespace per job: a rank's peers on other nodes reach it at the node's
own address and ports (rendezvous, gloo, NCCL over the host's interfaces); a namespace per job would need a
veth, routing and port forwarding per attempt to keep that working, and the rules say exactly what is refused.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import logging
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from trainyard_contract.errors import ConfigError

from trainyard_node_agent.network import ipv4_interfaces

log = logging.getLogger(__name__)

SETTING = "TRAINYARD_NODE_RANK_BLOCKED"
LOCAL = "local"  # Blocked.dest: any address of this node
ANY = "*"
CHAIN = "ranks_out"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})  # noqa: S104 - a listener's address, meaning this node
_ENTRY = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^\s\[\]:]*)):(?P<ports>\d+(?:-\d+)?)$")
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})$")


@dataclass(frozen=True)
class Target:
    """One entry of the setting as written: a host (``*``: any; a name, an address or a CIDR) and ports."""

    host: str
    ports: tuple[int, int]

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        lo, hi = self.ports
        return f"{host}:{lo}" if lo == hi else f"{host}:{lo}-{hi}"


@dataclass(frozen=True)
class Blocked:
    """One rule's destination: ``LOCAL`` (this node), ``ANY`` or a network (CIDR text), and its ports."""

    dest: str
    ports: tuple[int, int]


# ----------------------------------------------------------------------------- pure


def parse_entries(entries: Iterable[str]) -> list[Target]:
    """The setting's entries (``host:port``, ``[v6]:port``, ``cidr:lo-hi``, ``*:port``), validated; ValueError
    naming the first bad one."""
    found: list[Target] = []
    for raw in entries:
        text = raw.strip()
        if not text:
            continue
        match = _ENTRY.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not host:port (an IPv6 address in brackets: [::1]:6379)")
        host = (match["v6"] if match["v6"] is not None else match["host"]).strip().lower()
        lo, _, hi = match["ports"].partition("-")
        ports = (int(lo), int(hi or lo))
        if not 1 <= ports[0] <= ports[1] <= 65535:
            raise ValueError(f"{text!r}: ports must lie in 1-65535, low to high")
        if host not in (ANY, *_WILDCARDS) and _network(host) is None and not _NAME.match(host):
            raise ValueError(f"{text!r}: {host!r} is neither an address, a network nor a host name")
        found.append(Target(host, ports))
    return list(dict.fromkeys(found))


def resolve(targets: Sequence[Target], *, lookup: Callable[[str], list[str]],
            local_addresses: Iterable[str] = ()) -> list[Blocked]:
    """Each target as rule destinations: a loopback or wildcard host, or an address this node holds
    (``local_addresses``), is ``LOCAL``; ``*`` is ``ANY``; an address or network itself; a name what ``lookup``
    (name → addresses) says. Pure given ``lookup``; OSError from it propagates."""
    mine = {str(ipaddress.ip_address(a)) for a in local_addresses}
    out: list[Blocked] = []
    for target in targets:
        if target.host == ANY:
            out.append(Blocked(ANY, target.ports))
            continue
        if target.host in _WILDCARDS or target.host in _LOOPBACK_NAMES:
            out.append(Blocked(LOCAL, target.ports))
            continue
        network = _network(target.host)
        networks = [network] if network is not None else [ipaddress.ip_network(a) for a in lookup(target.host)]
        for net in networks:
            one = net.num_addresses == 1
            local = one and (net.network_address.is_loopback or str(net.network_address) in mine)
            out.append(Blocked(LOCAL if local else str(net), target.ports))
    return list(dict.fromkeys(out))


def table_name(node_id: str, scope: str = "") -> str:
    """``trainyard_<node id>_<hash>``: the node id in letters, digits and ``_``, then a short hash of the id and
    ``scope`` (the agent's state directory): an agent started again replaces its own table, while two agents of
    one host never share one, not with ids that differ only in punctuation, nor two local stacks' ``node-0``."""
    clean = re.sub(r"[^A-Za-z0-9_]", "_", node_id)[:64]
    digest = hashlib.sha256(f"{node_id}\0{scope}".encode()).hexdigest()[:8]
    return f"trainyard_{clean}_{digest}"


def render(table: str, blocked: Sequence[Blocked], *, first_uid: int, uid_count: int) -> str:
    """The nft script that (re)creates this agent's table: for sockets of the job uid range, new TCP
    connections to ``blocked`` are reset and UDP datagrams refused. One transaction: a stale table of the same
    name is replaced, never merged. ``table``: :func:`table_name`."""
    table = f"inet {table}"
    owner = f"meta skuid {first_uid}-{first_uid + uid_count - 1} ct state new"
    rules = []
    for b in blocked:
        dest = _match_dest(b.dest)
        lo, hi = b.ports
        port = str(lo) if lo == hi else f"{lo}-{hi}"
        rules.append(f"    {owner}{dest} meta l4proto tcp th dport {port} reject with tcp reset")
        rules.append(f"    {owner}{dest} meta l4proto udp th dport {port} reject")
    return "\n".join([
        f"table {table}",
        f"delete table {table}",
        f"table {table} {{",
        f"  chain {CHAIN} {{",
        "    type filter hook output priority filter; policy accept;",
        *rules,
        "  }",
        "}",
        "",
    ])


def render_delete(table: str) -> str:
    """The nft script that deletes the table (a no-op when there is none)."""
    table = f"inet {table}"
    return f"table {table}\ndelete table {table}\n"


def _match_dest(dest: str) -> str:
    if dest == ANY:
        return ""
    if dest == LOCAL:
        return " fib daddr type local"
    net = ipaddress.ip_network(dest)
    address = net.with_prefixlen if net.num_addresses > 1 else str(net.network_address)
    return f" {'ip' if net.version == 4 else 'ip6'} daddr {address}"


def _network(host: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(host, strict=False)
    except ValueError:
        return None


# ----------------------------------------------------------------------------- I/O


def lookup_host(name: str) -> list[str]:
    """The addresses ``name`` resolves to (both families)."""
    infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    return sorted({str(info[4][0]).split("%", 1)[0] for info in infos})


def this_node_addresses() -> list[str]:
    """The IPv4 addresses of this network namespace's interfaces (an entry naming one means this node)."""
    return sorted(set(ipv4_interfaces().values()))


def nft(script: str, *, binary: str = "nft", timeout_s: float = 15.0) -> None:
    """Apply ``script`` with ``nft -f -`` (one transaction); OSError with nft's message when it fails."""
    path = shutil.which(binary)
    if path is None:
        raise FileNotFoundError(f"{binary} not found on PATH (the nftables package)")
    done = subprocess.run([path, "-f", "-"], input=script, capture_output=True, text=True,  # noqa: S603 - nft found on PATH, our script
                          timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise OSError(f"nft -f - exited {done.returncode}: {(done.stderr or done.stdout).strip()[-600:]}")


def port_in_use(port: int) -> str | None:
    """Why a rank could not listen on ``port`` on this host, or None: the port is bound and listened on the way
    torch's TCPStore binds it (the wildcard address, IPv6 dual-stack where the host has IPv6, ``SO_REUSEADDR``,
    so a connection of an earlier attempt in TIME_WAIT does not count), then released at once. A listener of any
    user on any address of the host makes it fail."""
    families = ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")) if socket.has_ipv6 else (  # noqa: S104 - probing every address
        (socket.AF_INET, "0.0.0.0"),)  # noqa: S104 - probing every address
    for family, address in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 in this network namespace: the IPv4 wildcard below
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                sock.bind((address, port))
                sock.listen(1)
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue  # IPv6 disabled here: the IPv4 wildcard below
                return f"{exc.strerror or exc}"
            return None
    return None


class RankNetwork:
    """This agent's nftables table (see the module docstring): :meth:`install` at start-up, :meth:`remove` at
    close. Does nothing on a trusted node (ranks run as the agent's user: no uid tells them apart) or with
    nothing to block."""

    def __init__(self, node_id: str, entries: Sequence[str], *, enforced: bool, first_uid: int, uid_count: int,
                 scope: str = "", own_ports: Sequence[int | None] = (),
                 local_addresses: Callable[[], Iterable[str]] | None = None,
                 apply: Callable[[str], None] = nft, lookup: Callable[[str], list[str]] = lookup_host) -> None:
        self.table, self.enforced = table_name(node_id, scope), enforced
        self.first_uid, self.uid_count = first_uid, uid_count
        self.targets = parse_entries(entries)
        self.own = [Target("localhost", (p, p)) for p in own_ports if p]
        self._local = local_addresses or this_node_addresses
        self._apply, self._lookup = apply, lookup
        self.installed = False

    def install(self) -> None:
        """Replace this agent's table with the rules; ConfigError (the agent refuses to start) when they cannot
        be installed under enforce."""
        if not self.enforced:
            if self.targets:
                log.warning("%s is set, but ranks run as the agent's user (TRAINYARD_NODE_SANDBOX="
                            "trusted-single-tenant): no rule can tell them apart from the agent, none installed",
                            SETTING)
            return
        if not self.targets:
            log.warning("%s is empty: sandboxed ranks can open connections to anything this node reaches, the "
                        "control plane included (the broker, Redis, the API, metrics ports). List its endpoints "
                        "(host:port, comma-separated) to refuse them (docs/security.md)", SETTING)
            return
        targets = [*self.targets, *(t for t in self.own if t not in self.targets)]
        try:
            blocked = resolve(targets, lookup=self._lookup, local_addresses=self._local())
            self._apply(render(self.table, blocked, first_uid=self.first_uid, uid_count=self.uid_count))
        except (OSError, subprocess.SubprocessError) as exc:
            raise ConfigError(
                f"TRAINYARD_NODE_SANDBOX=enforce with {SETTING} set, but the rules that keep ranks off those "
                f"endpoints cannot be installed with nftables: {exc}. Install nftables (`nft`; "
                "scripts/ensure-system-deps.sh) and run the agent as root (CAP_NET_ADMIN), or empty "
                f"{SETTING} (ranks then reach the control plane: see docs/security.md)") from exc
        self.installed = True
        log.info("ranks (uids %d-%d) may not connect to %s (nftables table inet %s)", self.first_uid,
                 self.first_uid + self.uid_count - 1, ", ".join(str(t) for t in targets), self.table)

    def remove(self) -> None:
        """Delete the table this agent installed (best effort: logged when it fails)."""
        if not self.installed:
            return
        try:
            self._apply(render_delete(self.table))
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("could not delete the nftables table inet %s: %s", self.table, exc)
            return
        self.installed = False
        log.info("deleted the nftables table inet %s", self.table)
