"""The keyspace declaration (trainyard_runtime.keyspace) against the code: every key :class:`Keys` builds and
every ``"ty:`` literal in services/ and libs/ belongs to a declared family, each declared writer's code
writes its families, and the ACL rules generated from it give the node agent only its own keys."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from trainyard_runtime import keyspace
from trainyard_runtime.keyspace import FAMILIES, NODE_AGENT, SERVICES
from trainyard_runtime.store import Keys

ROOT = Path(__file__).resolve().parents[3]
SOURCES = sorted([*ROOT.glob("services/*/src/**/*.py"), *ROOT.glob("libs/*/src/**/*.py")])
_SAMPLE_ARGS = {"device_index": 0, "attempt": 1, "step": 2}


def _keys_members() -> dict[str, str]:
    """Each Keys attribute → a sample key it builds (methods called with sample arguments)."""
    out = {}
    for name, value in vars(Keys).items():
        if name.startswith("_"):
            continue
        if isinstance(value, str):
            out[name] = value
        elif isinstance(value, staticmethod):
            fn = value.__func__
            args = [_SAMPLE_ARGS.get(p, f"x-{p.replace('_', '-')}") for p in inspect.signature(fn).parameters]
            out[name] = fn(*args)
    return out


def _ty_literals() -> list[tuple[str, str]]:
    """(where, sample key) of every string literal that starts with ``ty:`` (an f-string's values ``x``)."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        joined = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in joined:
                text = node.value
            elif isinstance(node, ast.JoinedStr):
                text = "".join(str(v.value) if isinstance(v, ast.Constant) else "x" for v in node.values)
            else:
                continue
            if text.startswith("ty:"):
                found.append((where, text))
    return found


def _declared(sample: str) -> bool:
    """A key of a declared family or channel, or the leading segments of one (three at least, or two and a
    colon): a prefix the code completes (``f"ty:agent:{node}"`` + ``:epochs``, ``"ty:lease:"`` stripped off a
    scanned key)."""
    if keyspace.family_of(sample) or sample in {c.name for c in keyspace.CHANNELS}:
        return True
    segments = sample.removesuffix(":").split(":")
    return len(segments) >= 3 - sample.endswith(":") and any(_leads(segments, f.template) for f in FAMILIES)


def _leads(segments: list[str], template: str) -> bool:
    parts = template.split(":")
    if len(segments) > len(parts) or (len(segments) == len(parts) and not parts[-1].endswith("...>")):
        return False
    return all(keyspace._template_regex(p.replace("...", "")).fullmatch(s) for s, p in zip(segments, parts))


def test_every_key_built_by_keys_belongs_to_one_declared_family() -> None:
    prefixes = {"agent", "metrics_history"}  # prefixes of families (the rest of the key is the owner's)
    for name, key in _keys_members().items():
        if name in prefixes:
            assert _declared(key), (name, key)
            continue
        matching = [f for f in FAMILIES if f.matches(key)]
        assert matching, f"Keys.{name} builds {key!r}, in no declared family"
        fixed = [f for f in matching if "<" not in f.template]
        assert len(matching) == 1 or fixed == [keyspace.family_of(key)], (name, [f.name for f in matching])


def test_every_ty_literal_in_the_code_belongs_to_a_declared_family() -> None:
    literals = _ty_literals()
    assert len(literals) > 10  # the scan sees the code
    undeclared = [(where, key) for where, key in literals if not _declared(key)]
    assert not undeclared, f"keys outside any family of trainyard_runtime.keyspace: {undeclared}"


def test_the_scan_would_catch_an_undeclared_key() -> None:
    assert not _declared("ty:agent-secrets") and not _declared("ty:foo:x") and not _declared("ty:job:x:secrets")
    assert _declared("ty:job:x") and _declared("ty:lease:") and _declared("ty:agent:x")


def _references(family: keyspace.Family) -> set[str]:
    """The names the code writes ``family`` through: the Keys members whose keys are in it."""
    names = {name for name, key in _keys_members().items() if family.matches(key)}
    if family.name.startswith("agent-"):
        names.add("agent")
    if family.name == "metrics-history":
        names.add("metrics_history")
    return names


#: Families a service writes through a runtime helper rather than by naming the key: the helper's name in
#: the service's code stands for the key (the leases' Lua scripts, the change stream's stage_change, the
#: goodput ledgers' accountant).
_HELPERS = {"lease": "LeaseManager", "allocation": "LeaseManager", "epoch": "LeaseManager",
            "lease-audit": "LeaseManager", "changes": "stage_change", "goodput-final": "GoodputAccountant"}


def _code_of(service: str) -> str:
    return "\n".join(p.read_text() for p in ROOT.glob(f"services/{service}/src/**/*.py"))


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.per_service and set(f.writers) != set(SERVICES)],
                         ids=lambda f: f.name)
def test_each_declared_writer_uses_the_family(family: keyspace.Family) -> None:
    """A writer declared for a family its code never names is a stale declaration (and a wider ACL)."""
    names = _references(family)
    assert names, f"no Keys member builds the keys of {family.name}"
    for writer in family.writers:
        pattern = re.compile(r"\bKeys\.(" + "|".join(map(re.escape, names)) + r")\b"
                             + (rf"|\b{_HELPERS[family.name]}\b" if family.name in _HELPERS else ""))
        assert pattern.search(_code_of(writer)), f"{writer} is declared a writer of {family.name} but never " \
                                                 f"names Keys.{sorted(names)}"


#: Families a service reads through a StateStore method rather than by naming the key.
_STORE_READS = {"job": ("get_job", "get_jobs"), "jobs": ("list_job_ids",), "tenant-jobs": ("list_job_ids",),
                "checkpoints": ("list_checkpoints", "latest_ready_checkpoint", "get_checkpoint"),
                "datasets": ("get_dataset", "resolve_dataset", "list_datasets"),
                "dataset-rejections": ("get_dataset_rejection",), "artifacts": ("list_artifacts", "get_artifact"),
                "nodes": ("list_nodes",), "progress": ("get_progress",)}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.readers], ids=lambda f: f.name)
def test_each_declared_reader_reads_the_family(family: keyspace.Family) -> None:
    """A stale read is a wider ACL than the code needs. The API reads telemetry's read models through
    ``trainyard_telemetry``'s stores, so telemetry's code counts as the API's for telemetry's families."""
    names = _references(family)
    for reader in family.readers:
        code = _code_of(reader)
        if "telemetry" in family.writers and "trainyard_telemetry" in code:  # through telemetry's readers
            code += _code_of("telemetry")
        named = re.search(r"\bKeys\.(" + "|".join(map(re.escape, names)) + r")\b", code) if names else None
        assert named or any(f".{m}(" in code for m in _STORE_READS.get(family.name, ())), \
            f"{reader} is declared a reader of {family.name} but its code never reads it"


def test_the_per_service_families_are_written_by_the_runtime_every_service_runs() -> None:
    runtime = "\n".join(p.read_text() for p in ROOT.glob("libs/runtime/src/trainyard_runtime/*.py"))
    for name in ("outbox", "health", "stuck", "seen"):
        assert re.search(rf"\bKeys\.{name}\(", runtime), name


def test_the_node_agent_writes_only_its_own_keys() -> None:
    writes = keyspace.writes_of(NODE_AGENT)
    assert writes == ["ty:agent:*:epochs", "ty:agent:*:launched", "ty:agent:*:ranks", "ty:agent:*:refused",
                      "ty:agent:*:unconfirmed", "ty:agent:*:gangs", "ty:outbox:node-agent:*", "ty:health:node-agent:*",
                      "ty:stuck:node-agent:*", "ty:seen:node-agent:*:*", "ty:replication:barrier",
                      "ty:replication:ack:*"]
    assert keyspace.wider_writes(NODE_AGENT) == []
    rules = keyspace.acl_rules(NODE_AGENT)
    for foreign in ("ty:job:*", "ty:tenants", "ty:tokens", "ty:sched:leader", "ty:lease:*:*", "ty:epoch:*"):
        assert f" ~{foreign} " not in f" {rules} "


def test_wider_writes_are_only_the_job_records_subkeys() -> None:
    """A glob cannot stop at a colon: the API's and the scheduler's ``ty:job:*`` cover the job's sub-keys
    (progress, advice, …). That is the one widening; every other service writes exactly its families."""
    for service in SERVICES:
        assert {glob for glob, _ in keyspace.wider_writes(service)} <= {"ty:job:*"}, service
    assert {f for _, f in keyspace.wider_writes("scheduler")} >= {"progress", "checkpoint-advice"}


def test_the_rules_keep_dangerous_commands_out_and_name_the_doorbell() -> None:
    for service in SERVICES:
        rules = keyspace.acl_rules(service)
        assert rules.endswith("+@all -@dangerous") and "&ty:bus:doorbell" in rules and "~ty:* " not in rules
        assert not [r for r in rules.split() if r.startswith("&*") or r in ("~*", "allkeys", "allchannels")]


def test_glob_matching_follows_redis() -> None:
    assert keyspace.glob_matches("ty:job:*", "ty:job:a:progress")
    assert not keyspace.glob_matches("ty:outbox:api", "ty:outbox:api2")
    assert keyspace.glob_matches("ty:mh:{*}:*", "ty:mh:{job-1}:0:att")
    assert keyspace.glob_matches(r"a\*b", "a*b") and not keyspace.glob_matches(r"a\*b", "axb")


@pytest.mark.parametrize("service", [s for s in SERVICES if s != "telemetry"] + ["telemetry"])
def test_every_family_a_service_names_is_declared_for_it(service: str) -> None:
    """The other direction: a service whose code names a family's keys (itself, or through telemetry's
    readers) is one of its writers or readers, or its ACL refuses it at run time (NOPERM)."""
    code = _code_of(service)
    if service != "telemetry":  # the telemetry modules it imports read for it
        for module in sorted(set(re.findall(r"from trainyard_telemetry\.(\w+) import", code))):
            code += (ROOT / "services/telemetry/src/trainyard_telemetry" / f"{module}.py").read_text()
    undeclared = []
    for family in FAMILIES:
        if family.per_service or service in family.writers or service in family.readers:
            continue
        names = _references(family) - {"agent", "metrics_history"}
        if names and re.search(r"\bKeys\.(" + "|".join(map(re.escape, sorted(names))) + r")\(", code):
            undeclared.append(family.name)
    assert not undeclared, f"{service} names the keys of {undeclared} without being declared their reader or writer"
