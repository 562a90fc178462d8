"""What sandboxed ranks may not connect to (rank_network.py): the setting parsed, resolved and rendered as
nftables rules (pure, table-driven); the shell's decisions with nft injected; the master-port check."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.unit.trainyard_node_agent.test_admission import gang
from trainyard_contract.errors import ConfigError
from trainyard_node_agent import rank_network as rn
from trainyard_node_agent.admission import hosts_rendezvous, port_taken
from trainyard_node_agent.settings import NodeAgentSettings

FIRST, COUNT = 1_000_000_000, 2**20
OWNER = "meta skuid 1000000000-1001048575 ct state new"


@pytest.mark.parametrize(("text", "parsed"), [
    ("127.0.0.1:6390", [rn.Target("127.0.0.1", (6390, 6390))]),
    ("localhost:9092, [::1]:8080", [rn.Target("localhost", (9092, 9092)), rn.Target("::1", (8080, 8080))]),
    ("*:9400", [rn.Target("*", (9400, 9400))]),
    ("10.0.0.0/8:6379-6381", [rn.Target("10.0.0.0/8", (6379, 6381))]),
    ("[fd00::/8]:1", [rn.Target("fd00::/8", (1, 1))]),
    ("Redis.Example:6379,redis.example:6379,,", [rn.Target("redis.example", (6379, 6379))]),  # once, lower case
    ("0.0.0.0:8080", [rn.Target("0.0.0.0", (8080, 8080))]),
    ("", []),
])
def test_entries_are_parsed(text: str, parsed: list[rn.Target]) -> None:
    assert rn.parse_entries(text.split(",")) == parsed


@pytest.mark.parametrize(("text", "why"), [
    ("6390", "is not host:port"),
    ("localhost:", "is not host:port"),
    ("::1:8080", "is not host:port"),  # an IPv6 address needs brackets
    ("localhost:0", "ports must lie in 1-65535"),
    ("localhost:70000", "ports must lie in 1-65535"),
    ("localhost:9-8", "low to high"),
    ("bad_name!:80", "neither an address, a network nor a host name"),
])
def test_bad_entries_are_refused_naming_them(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        rn.parse_entries([text])


def lookup(name: str) -> list[str]:
    return {"redis.internal": ["10.1.2.3", "fd00::5"], "me.internal": ["192.0.2.2"]}[name]


@pytest.mark.parametrize(("entry", "blocked"), [
    ("localhost:9092", [rn.Blocked(rn.LOCAL, (9092, 9092))]),  # this node, whichever address
    ("127.0.0.1:6390", [rn.Blocked(rn.LOCAL, (6390, 6390))]),
    ("127.0.0.2:6390", [rn.Blocked(rn.LOCAL, (6390, 6390))]),
    ("[::1]:8080", [rn.Blocked(rn.LOCAL, (8080, 8080))]),
    ("0.0.0.0:8080", [rn.Blocked(rn.LOCAL, (8080, 8080))]),
    ("192.0.2.2:9400", [rn.Blocked(rn.LOCAL, (9400, 9400))]),  # one of this node's own addresses
    ("me.internal:9400", [rn.Blocked(rn.LOCAL, (9400, 9400))]),
    ("*:9400", [rn.Blocked(rn.ANY, (9400, 9400))]),
    ("10.0.0.0/8:6379", [rn.Blocked("10.0.0.0/8", (6379, 6379))]),
    ("10.9.9.9:6379", [rn.Blocked("10.9.9.9/32", (6379, 6379))]),
    ("redis.internal:6379", [rn.Blocked("10.1.2.3/32", (6379, 6379)), rn.Blocked("fd00::5/128", (6379, 6379))]),
])
def test_targets_resolve_to_rule_destinations(entry: str, blocked: list[rn.Blocked]) -> None:
    assert rn.resolve(rn.parse_entries([entry]), lookup=lookup, local_addresses=["192.0.2.2"]) == blocked


@pytest.mark.parametrize(("blocked", "rules"), [
    (rn.Blocked(rn.LOCAL, (6390, 6390)),
     [f"{OWNER} fib daddr type local meta l4proto tcp th dport 6390 reject with tcp reset",
      f"{OWNER} fib daddr type local meta l4proto udp th dport 6390 reject"]),
    (rn.Blocked(rn.ANY, (9400, 9400)),
     [f"{OWNER} meta l4proto tcp th dport 9400 reject with tcp reset",
      f"{OWNER} meta l4proto udp th dport 9400 reject"]),
    (rn.Blocked("10.0.0.0/8", (6379, 6381)),
     [f"{OWNER} ip daddr 10.0.0.0/8 meta l4proto tcp th dport 6379-6381 reject with tcp reset",
      f"{OWNER} ip daddr 10.0.0.0/8 meta l4proto udp th dport 6379-6381 reject"]),
    (rn.Blocked("fd00::5/128", (6379, 6379)),
     [f"{OWNER} ip6 daddr fd00::5 meta l4proto tcp th dport 6379 reject with tcp reset",
      f"{OWNER} ip6 daddr fd00::5 meta l4proto udp th dport 6379 reject"]),
])
def test_each_destination_renders_a_tcp_and_a_udp_rule_for_the_job_uid_range(blocked: rn.Blocked,
                                                                            rules: list[str]) -> None:
    script = rn.render("trainyard_node_0_x", [blocked], first_uid=FIRST, uid_count=COUNT)
    assert [line.strip() for line in script.splitlines() if line.strip().startswith("meta skuid")] == rules


def test_the_script_replaces_the_agents_own_table_in_one_transaction() -> None:
    table = rn.table_name("node-0", "/state/nodes/node-0")
    script = rn.render(table, [], first_uid=FIRST, uid_count=COUNT)
    assert script.splitlines()[:4] == [f"table inet {table}", f"delete table inet {table}",
                                       f"table inet {table} {{", f"  chain {rn.CHAIN} {{"]
    assert "type filter hook output priority filter; policy accept;" in script
    assert rn.render_delete(table) == f"table inet {table}\ndelete table inet {table}\n"


@pytest.mark.parametrize(("node_id", "prefix"), [
    ("node_0", "trainyard_node_0_"),
    ("n1", "trainyard_n1_"),
    ("gpu-17.rack-3", "trainyard_gpu_17_rack_3_"),
])
def test_table_names_come_from_the_node_id(node_id: str, prefix: str) -> None:
    name = rn.table_name(node_id, "/state")
    assert name.startswith(prefix) and len(name) == len(prefix) + 8
    assert all(c.isalnum() or c == "_" for c in name)
    assert rn.table_name(node_id, "/state") == name  # an agent started again replaces its own


def test_two_agents_of_one_host_never_share_a_table() -> None:
    names = {rn.table_name(n, "/a") for n in ("node-0", "node.0", "node_0")} | {rn.table_name("node-0", "/b")}
    assert len(names) == 4  # ids differing in punctuation; two local stacks' node-0


def shell(entries: list[str], *, enforced: bool = True, fails: bool = False,
          own_ports: tuple[int | None, ...] = ()) -> tuple[rn.RankNetwork, list[str]]:
    applied: list[str] = []

    def apply(script: str) -> None:
        if fails:
            raise FileNotFoundError("nft not found on PATH (the nftables package)")
        applied.append(script)

    return rn.RankNetwork("node-0", entries, enforced=enforced, first_uid=FIRST, uid_count=COUNT, scope="/s",
                          own_ports=own_ports, local_addresses=lambda: [], apply=apply, lookup=lookup), applied


def test_install_applies_the_rules_with_the_agents_metrics_port_and_remove_deletes_them() -> None:
    net, applied = shell(["localhost:6390"], own_ports=(9400, None))
    net.install()
    assert len(applied) == 1 and "th dport 6390 " in applied[0] and "th dport 9400 " in applied[0]
    net.remove()
    net.remove()  # idempotent
    assert applied[1:] == [rn.render_delete(rn.table_name("node-0", "/s"))]


def test_under_enforce_rules_that_cannot_be_installed_refuse_the_start_naming_nftables_and_the_setting() -> None:
    net, _ = shell(["localhost:6390"], fails=True)
    with pytest.raises(ConfigError) as refused:
        net.install()
    assert "nftables" in str(refused.value) and rn.SETTING in str(refused.value)
    assert not net.installed


@pytest.mark.parametrize(("entries", "enforced", "warning"), [
    ([], True, "sandboxed ranks can open connections to anything this node reaches"),
    (["localhost:6390"], False, "no rule can tell them apart from the agent"),
])
def test_nothing_is_applied_without_endpoints_or_sandbox_and_it_says_so(
        entries: list[str], enforced: bool, warning: str, caplog: pytest.LogCaptureFixture) -> None:
    net, applied = shell(entries, enforced=enforced, fails=True)  # nft is never called
    net.install()
    net.remove()
    assert applied == [] and warning in caplog.text


def test_the_setting_is_a_comma_list_validated_at_start_up() -> None:
    base = {"node_id": "n", "kafka_bootstrap": "k:1", "redis_url": "redis://r"}
    settings = NodeAgentSettings(**base, node_rank_blocked="[::1]:8080, localhost:9092")  # type: ignore[arg-type]  # settings from strings, as the environment gives them
    assert settings.node_rank_blocked == ["[::1]:8080", "localhost:9092"]
    assert NodeAgentSettings(**base).node_rank_blocked == []  # type: ignore[arg-type]  # settings from strings, as the environment gives them
    with pytest.raises(ValidationError, match="is not host:port"):
        NodeAgentSettings(**base, node_rank_blocked="localhost")  # type: ignore[arg-type]  # settings from strings, as the environment gives them


def test_a_port_someone_listens_on_is_in_use_and_a_released_one_is_free() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))  # a loopback listener takes the port for the wildcard too
        holder.listen()
        port = holder.getsockname()[1]
        why = rn.port_in_use(port)
        assert why is not None and "in use" in why
    assert rn.port_in_use(port) is None


def test_only_the_node_of_rank_0_checks_and_the_detail_names_the_port() -> None:
    event = gang()
    first, *rest = event.nodes
    assert hosts_rendezvous(first) and not any(hosts_rendezvous(n) for n in rest)
    detail = port_taken(event, "n0", "Address already in use")
    assert f"rendezvous port {event.master_port} is already in use on n0 (Address already in use)" in detail


@pytest.mark.parametrize(("settings", "env", "expected"), [
    ({}, {}, ["127.0.0.1:9092", "127.0.0.1:6390", "127.0.0.1:8080"]),
    ({"redis_ha": True}, {},
     ["127.0.0.1:9092", "127.0.0.1:6390", "127.0.0.1:6391", "127.0.0.1:26390", "127.0.0.1:26391", "127.0.0.1:26392",
      "127.0.0.1:8080"]),
    ({"kafka_bootstrap": "10.0.0.9:9092,10.0.0.10:9092", "redis_url": "redis+sentinel://u:p@[::1]:26390,h:26391/ty/0"},
     {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000"},
     ["10.0.0.9:9092", "10.0.0.10:9092", "[::1]:26390", "h:26391", "127.0.0.1:8080", "127.0.0.1:9000"]),
])
def test_the_local_stack_lists_its_control_plane_for_its_agents(tmp_path: Path, settings: dict,
                                                               env: dict[str, str], expected: list[str]) -> None:
    from trainyard_cli.stack import LocalStack, StackSettings

    stack = LocalStack(StackSettings(state_dir=tmp_path / ".trainyard", **settings))
    listed = stack.control_plane(env)
    assert listed == expected
    assert [str(t) for t in rn.parse_entries(listed)] == expected  # what the agents' setting accepts


def test_with_prometheus_every_metrics_port_and_prometheus_are_listed_before_they_start(tmp_path: Path) -> None:
    from trainyard_cli.stack import SERVICES, LocalStack, StackSettings

    stack = LocalStack(StackSettings(state_dir=tmp_path / ".trainyard", prometheus=True, nodes=2))
    listed = stack.control_plane({})
    later = [stack._port(n) for n in (*SERVICES, "node-agent-0", "node-agent-1", "prometheus")]  # noqa: SLF001 - the ports it chose
    assert len(set(later)) == len(later) and all(f"127.0.0.1:{p}" in listed for p in later)
