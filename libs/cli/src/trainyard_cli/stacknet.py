"""The local stack's ports and the rank network block list: every endpoint of the control plane a rank must
not reach (the node agents' ``TRAINYARD_NODE_RANK_BLOCKED``), and the metrics ports chosen for it.

A metrics port is chosen once per component (:class:`MetricsPorts`), before the node agents start, so that
the agents' block list already names the ports of every service, the telemetry service's included, and
Prometheus' own. Pure except the free-port search.
"""

from __future__ import annotations

from trainyard_cli import infra

__all__ = ["MetricsPorts", "rank_blocked"]


class MetricsPorts:
    """The metrics port of each component (and Prometheus' port), chosen once in this process."""

    def __init__(self) -> None:
        self._ports: dict[str, int] = {}

    def port(self, component: str) -> int:
        if component not in self._ports:
            self._ports[component] = infra.free_port()
        return self._ports[component]


def rank_blocked(*, kafka_bootstrap: str, redis_url: str | None, redis: list[str], api_port: int,
                 metrics_ports: list[int], env: dict[str, str]) -> list[str]:
    """The ``host:port`` entries of a local stack's control plane (see :meth:`LocalStack.control_plane`). Pure."""
    found = [b.strip() for b in kafka_bootstrap.split(",") if b.strip()]
    found += [*redis, *url_endpoints(redis_url), f"127.0.0.1:{api_port}"]
    found += [f"127.0.0.1:{p}" for p in metrics_ports]
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        found += url_endpoints(env.get(name))
    return list(dict.fromkeys(found))


def url_endpoints(url: str | None) -> list[str]:
    """``host:port`` of each host of a URL (``redis+sentinel://a:1,b:2/…`` names several; default ports by
    scheme), none when there is no URL."""
    if not url or "://" not in url:
        return []
    scheme, rest = url.split("://", 1)
    hosts = rest.split("/", 1)[0].rpartition("@")[2]
    default = {"http": 80, "https": 443, "redis": 6379, "rediss": 6379}.get(
        scheme, 26379 if "sentinel" in scheme else 0)
    out = []
    for host in filter(None, hosts.split(",")):
        if host.startswith("["):  # [v6]:port
            addr, _, port = host[1:].partition("]")
            port = port.lstrip(":")
            out.append(f"[{addr}]:{port or default}")
            continue
        addr, _, port = host.partition(":")
        out.append(f"{addr}:{port or default}")
    return [e for e in out if not e.endswith(":0")]
