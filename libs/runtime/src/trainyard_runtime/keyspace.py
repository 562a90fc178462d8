"""Who owns each Redis key family, and who reads it: the one declaration the ACLs are generated from.

Every key trainyard keeps in Redis belongs to a :class:`Family`: a key template (``ty:job:<job>``), the
services that write it and the services that read it. Pub/sub channels are declared the same way
(:class:`Channel`). :func:`acl_rules` turns the declaration into each service's Redis 7 ACL rules
(``~glob`` read-write for what it writes, ``%R~glob`` read-only for what it reads, ``&channel``), so
a service — the node agent above all, on hosts that run untrusted code — can write only its own keys
(docs/security.md "Redis"; docs/design.md §5 key table).

One writer per family is the rule. The exceptions are declared, each with its reason:

* the job record, the job indexes and the change stream: the API creates a job (record, indexes, change
  entry and the scheduler's incoming set in one MULTI), the scheduler moves it through its states;
* ``ty:sched:tenant-config``: the API sets a tenant's settings, the scheduler seeds the queue file's
  tenants that have none (HSETNX);
* ``ty:export:<id>``: the API or the registry writes the REQUESTED record in the MULTI that stages the
  ExportRequested, the registry then READY/FAILED;
* ``ty:goodput:final``: a finished job's ledger, computed once and kept: by telemetry's walks, or by the API
  when a GET comes first (both through telemetry's ``GoodputAccountant``);
* ``ty:replication:*``: every service's confirmed writes (random tokens, nothing is read back by another).

Families kept per writer (outboxes, health beacons, stuck-partition lists, consumer dedup keys) carry
``<service>`` in their template: each service gets only its own prefix.

A glob cannot stop at a colon, so a writer of ``ty:job:<job>`` may, as far as Redis is concerned, also
write ``ty:job:<job>:progress``; :func:`wider_writes` lists every such case so that the tests can hold it
to what is declared here (the node agent has none). Pure data; nothing here touches Redis.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

__all__ = [
    "API", "CHANNELS", "COORDINATOR", "FAMILIES", "NODE_AGENT", "OPERATOR", "REGISTRY", "SCHEDULER",
    "SERVICES", "TELEMETRY", "Channel", "Family", "acl_rules", "family_of", "glob_matches", "reads_of",
    "wider_writes", "writes_of",
]

API = "api"
SCHEDULER = "scheduler"
NODE_AGENT = "node-agent"
COORDINATOR = "checkpoint-coordinator"
REGISTRY = "registry"
TELEMETRY = "telemetry"
OPERATOR = "operator"  # people's tools (the CLI's dev commands, redis-cli): every key, outside this declaration
SERVICES = (API, SCHEDULER, NODE_AGENT, COORDINATOR, REGISTRY, TELEMETRY)
CONTROL_PLANE = (API, SCHEDULER, COORDINATOR, REGISTRY, TELEMETRY)  # every service but the node agent

_PLACEHOLDER = re.compile(r"<([a-z_]+)(\.\.\.)?>")  # <name> a value without a colon, <name...> any


@dataclass(frozen=True)
class Family:
    """Keys of one shape: ``template`` with ``<name>`` placeholders (a value without a colon; ``<name...>``: any
    rest of the key)."""

    name: str
    template: str
    writers: tuple[str, ...]
    readers: tuple[str, ...] = ()
    doc: str = ""

    @property
    def per_service(self) -> bool:
        """Split by writer: each writer's keys carry its own name where the template says ``<service>``."""
        return "<service>" in self.template

    def glob(self, service: str | None = None) -> str:
        """The ACL key pattern: each placeholder a ``*`` (``<service>`` the writer's name, then ``*``)."""
        template = self.template
        if service is not None and self.per_service:
            template = template.replace("<service>", _glob_escape(service), 1)
        return _PLACEHOLDER.sub("*", template)

    def matches(self, key: str) -> bool:
        """Whether ``key`` is one of this family's (a placeholder stands for a value without a colon)."""
        return _template_regex(self.template).fullmatch(key) is not None


@dataclass(frozen=True)
class Channel:
    """A pub/sub channel and who publishes and subscribes (both need ``&channel`` in the ACL)."""

    name: str
    users: tuple[str, ...]
    doc: str = ""


def _f(name: str, template: str, writers: Iterable[str], readers: Iterable[str] = (), doc: str = "") -> Family:
    return Family(name, template, tuple(writers), tuple(r for r in readers if r not in writers), doc)


_ALL = SERVICES
_A, _S, _N, _C, _R, _T = API, SCHEDULER, NODE_AGENT, COORDINATOR, REGISTRY, TELEMETRY

FAMILIES: tuple[Family, ...] = (
    # jobs ------------------------------------------------------------------------------------------------
    _f("job", "ty:job:<job>", (_A, _S), _ALL, "JSON JobRecord: created by the API, moved by the scheduler"),
    _f("jobs", "ty:jobs", (_A,), (_S, _T), "zset of every job id by creation time"),
    _f("tenant-jobs", "ty:tenant:<tenant>:jobs", (_A,), (_T,), "zset: one tenant's job ids"),
    _f("job-children", "ty:job:<job>:children", (_A,), (), "zset: jobs initialised from this one"),
    _f("control-requests", "ty:job:<job>:control", (_A,), (_S,), "hash: the control requests the API accepted"),
    _f("changes", "ty:changes", (_A, _S), (), "stream: a job or node changed (the scheduler's wake-up)"),
    _f("incoming-jobs", "ty:sched:incoming", (_A, _S), (), "set: jobs stored, not yet taken in by the scheduler"),
    # tenants, tokens, audit, triggers (api) ---------------------------------------------------------------
    _f("tenants", "ty:tenants", (_A,), (), "hash tenant → TenantRecord"),
    _f("tenants-bootstrap-lock", "ty:tenants:bootstrap-lock", (_A,), (), "the first worker's bootstrap lock"),
    _f("tokens", "ty:tokens", (_A,), (), "hash sha256(token) → TenantToken"),
    _f("tenant-config", "ty:sched:tenant-config", (_A, _S), (), "hash tenant → the scheduler's TenantConfig"),
    _f("audit", "ty:audit", (_A,), (), "stream: administrative and job-control actions"),
    _f("tenant-audit", "ty:audit:tenant:<tenant>", (_A,), (), "stream: one tenant's audit entries"),
    _f("triggers", "ty:triggers", (_A,), (), "hash trigger id → TriggerRecord"),
    _f("tenant-triggers", "ty:tenant:<tenant>:triggers", (_A,), (), "hash trigger name → id"),
    _f("trigger-jobs", "ty:trigger:<trigger>:jobs", (_A,), (), "hash dataset ref → job the trigger submitted"),
    _f("trigger-failure", "ty:trigger:<trigger>:failure", (_A,), (), "JSON: the trigger's last failure"),
    _f("experiments", "ty:experiments", (_A,), (), "hash experiment id → ExperimentRecord (the search's state)"),
    _f("tenant-experiments", "ty:tenant:<tenant>:experiments", (_A,), (), "hash experiment name → id"),
    _f("experiments-active", "ty:experiments:active", (_A,), (), "set: experiments whose search is not over"),
    _f("experiment-driver", "ty:experiment-driver:<experiment>", (_A,), (),
       "'<instance>' of the API process driving the experiment's search, with a TTL"),
    # scheduler ---------------------------------------------------------------------------------------------
    _f("queue-config", "ty:sched:queue-config", (), (_S,), "JSON QueueConfig, set by an operator"),
    _f("active-jobs", "ty:sched:active", (_S,), (), "set: jobs taken in, not yet terminal"),
    _f("leader", "ty:sched:leader", (_S,), (), "'<epoch> <instance>' of the leader, with a TTL"),
    _f("leader-epoch", "ty:sched:leader-epoch", (_S,), (), "takeover counter, never decreasing"),
    _f("nodes", "ty:nodes", (_S,), (_A,), "hash node id → NodeRecord (from heartbeats)"),
    _f("node-reputation", "ty:sched:node-reputation", (_S,), (_A,), "hash node id → decaying failure score"),
    _f("node-quarantine", "ty:sched:node-quarantine", (_S,), (_A,), "hash node id → why it is not placed on"),
    _f("node-drain", "ty:sched:node-drain", (_S,), (_A, _N), "hash node id → drained nodes"),
    _f("lease", "ty:lease:<node>:<device>", (_S,), (_N,), "a device's holder (Lua, leader-fenced)"),
    _f("replica", "ty:replica:<allocation>:<rank>", (_S,), (_N,), "faultTolerance: a replaced rank's generation"),
    _f("allocation", "ty:alloc:<allocation>", (_S,), (), "an allocation's devices and state (Lua)"),
    _f("epoch", "ty:epoch:<job>", (_S,), (_C,), "a job's fencing epoch, never decreasing (Lua)"),
    _f("lease-audit", "ty:lease-audit", (_S,), (), "stream: every grant and release"),
    # node agent (its own keys only) --------------------------------------------------------------------------
    _f("agent-epochs", "ty:agent:<node>:epochs", (_N,), (), "hash job → highest epoch seen on the node"),
    _f("agent-launched", "ty:agent:<node>:launched", (_N,), (), "set: allocation ids launched on the node"),
    _f("agent-ranks", "ty:agent:<node>:ranks", (_N,), (), "hash: the node's running ranks"),
    _f("agent-refused", "ty:agent:<node>:refused", (_N,), (), "list: the node's recent refusals"),
    _f("agent-unconfirmed", "ty:agent:<node>:unconfirmed", (_N,), (), "hash: announcements not yet applied"),
    _f("agent-gangs", "ty:agent:<node>:gangs", (_N,), (), "hash: fault-tolerant allocations launched on the node"),
    # checkpoint coordinator -----------------------------------------------------------------------------------
    _f("checkpoints", "ty:ckpt:<job>", (_C,), (_A, _S, _N, _R, _T), "hash checkpoint id → CheckpointRecord"),
    _f("shards", "ty:ckpt:<job>:shards:<attempt>:<step>", (_C,), (_N, _S), "hash rank → ShardReport"),
    _f("shard-timing", "ty:ckpt:<job>:shards:<attempt>:<step>:timing", (_C,), (), "hash rank → save timing"),
    _f("checkpoint-jobs", "ty:ckpt:jobs", (_C,), (_R,), "zset: jobs the coordinator's GC looks at"),
    _f("pending-checkpoints", "ty:ckpt-pending", (_C,), (), "zset: PENDING checkpoints to time out"),
    _f("live-steps", "ty:ckpt:live-steps", (_C,), (), "hash job → rank 0's furthest (attempt, step)"),
    _f("checkpoint-timing", "ty:ckpt:<job>:timing", (_C,), (), "hash: step time and checkpoint stalls"),
    _f("checkpoint-protection", "ty:job:<job>:ckpt-protection", (_C,), (_A,), "JSON: READY checkpoints' cover"),
    _f("checkpoint-advice", "ty:job:<job>:ckpt-advice", (_C,), (_A, _S), "JSON: Young/Daly interval advice"),
    _f("failure-stats", "ty:failures:<device_type>", (_C,), (), "hash: failures and exposure by device"),
    _f("failures-seen", "ty:failures:seen:<job>:<attempt>", (_C,), (), "an attempt's failure counted once"),
    # registry -------------------------------------------------------------------------------------------------
    _f("datasets", "ty:datasets", (_R,), (_A, _S), "hash qualified ref → DatasetRecord"),
    _f("dataset-rejections", "ty:dataset-rejections", (_R,), (_A,), "hash ref → the latest DatasetRejection"),
    _f("artifacts", "ty:artifacts:<job>", (_R,), (_A,), "hash artifact id → ArtifactRecord"),
    _f("export", "ty:export:<export>", (_A, _R), (), "JSON ExportRecord: requested (api or registry), done"),
    _f("registry-live", "ty:registry:live", (_R,), (), "zset: jobs with artifacts not yet retired"),
    _f("evaluations", "ty:evals:<job>", (_R,), (_A, _T), "hash evaluation job id → EvaluationResult"),
    # telemetry: the StepMetrics read models ---------------------------------------------------------------
    _f("progress", "ty:job:<job>:progress", (_T,), (_A,), "JSON Progress of the job"),
    _f("attempt-steps", "ty:job:<job>:steps:<attempt>", (_T,), (_A, _C), "hash: rank 0's step timing"),
    _f("attempt-step-points", "ty:job:<job>:steps:<attempt>:cum", (_T,), (_A,), "zset step → work seconds"),
    _f("rank-timing", "ty:job:<job>:ranks:<attempt>", (_T,), (_A,), "hash rank → latest timing breakdown"),
    _f("stragglers", "ty:job:<job>:stragglers", (_T,), (_A,), "list: StragglerDetected, newest first"),
    _f("metrics-history", "ty:mh:{<job>}:<part...>", (_T,), (_A,), "a job's downsampled series and indexes"),
    _f("goodput-final", "ty:goodput:final", (_T, _A), (), "hash job → ledger of a finished job (a cache)"),
    _f("goodput-history-tenants", "ty:goodput:hist-tenants", (_T,), (_A,), "set: tenants with a history"),
    _f("goodput-history", "ty:goodput:hist:<tenant>", (_T,), (_A,), "hash bucket → cumulative ledger"),
    _f("calibration", "ty:calib:fit", (_T,), (_A,), "JSON: the planner's fitted Calibration"),
    _f("calibration-devices", "ty:calib:devices", (_T,), (_A,), "set: device types with samples"),
    _f("calibration-failures-seen", "ty:calib:failures-seen", (_T,), (), "zset: failures sampled"),
    _f("calibration-samples", "ty:calib:samples:<device_type>:<kind>", (_T,), (_A,), "list: newest samples"),
    _f("tracking-tenants", "ty:tracking:tenants", (_A,), (_T,), "hash tenant → TenantTracking (platform-admin)"),
    _f("tracking-jobs", "ty:tracking:jobs", (_T,), (), "zset: jobs with metrics the tracking exporter looks at"),
    _f("tracking-cursor", "ty:tracking:cursor:<job>", (_T,), (), "hash target → the exporter's cursor of the job"),
    # every service, each its own ------------------------------------------------------------------------------
    _f("outbox", "ty:outbox:<service>", CONTROL_PLANE, (), "stream: events staged with the writes that caused them"),
    _f("agent-outbox", "ty:outbox:node-agent:<node>", (_N,), (), "stream: one node agent's staged events"),
    _f("health", "ty:health:<service>:<instance>", _ALL, (), "a live instance's beacon (pid, TTL)"),
    _f("stuck", "ty:stuck:<service>:<instance>", _ALL, (_A,), "JSON: partitions held on one record"),
    _f("seen", "ty:seen:<service>:<group>:<event>", _ALL, (), "a consumer group handled this eventId (TTL)"),
    _f("replication-barrier", "ty:replication:barrier", _ALL, (), "INCRed before a WAIT (see replication.py)"),
    _f("replication-ack", "ty:replication:ack:<token>", _ALL, (), "a confirmed write's token (TTL)"),
)

CHANNELS: tuple[Channel, ...] = (
    Channel("ty:bus:doorbell", _ALL, "a topic got an event: idle consumers fetch now (idlefetch.py)"),
)

_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    return _BY_NAME[name]


def family_of(key: str) -> Family | None:
    """The family ``key`` belongs to (None: an undeclared key). A fixed name wins over a template it also
    fits (``ty:ckpt:jobs`` is the GC index, not the checkpoints of a job named ``jobs``: job ids are ``job-…``)."""
    matching = [f for f in FAMILIES if f.matches(key)]
    return max(matching, key=lambda f: len(_PLACEHOLDER.sub("", f.template)), default=None)


def writes_of(service: str) -> list[str]:
    """The key globs ``service`` may write (and read)."""
    return _unique(f.glob(service) for f in FAMILIES if service in f.writers)


def reads_of(service: str) -> list[str]:
    """The key globs ``service`` may only read (not already among its writes)."""
    writes = set(writes_of(service))
    return [g for g in _unique(f.glob() for f in FAMILIES if service in f.readers) if g not in writes]


def channels_of(service: str) -> list[str]:
    return [c.name for c in CHANNELS if service in c.users]


def acl_rules(service: str) -> str:
    """``service``'s ACL rules (Redis 7): its writes, its reads, its channels, every command but @dangerous."""
    rules = [f"~{g}" for g in writes_of(service)]
    rules += [f"%R~{g}" for g in reads_of(service)]
    rules += [f"&{_glob_escape(c)}" for c in channels_of(service)]
    return " ".join([*rules, "+@all", "-@dangerous"])


def wider_writes(service: str) -> list[tuple[str, str]]:
    """(glob, family) pairs where one of ``service``'s write globs also covers a family it does not write —
    a glob cannot stop at a colon (``ty:job:*`` covers ``ty:job:<job>:progress``)."""
    out = []
    for glob in writes_of(service):
        for f in FAMILIES:
            if service not in f.writers and glob_matches(glob, _sample(f.template)):
                out.append((glob, f.name))
    return out


def glob_matches(glob: str, key: str) -> bool:
    """Redis's glob (``*``, ``?`` and ``\\``-escapes, as ACL key patterns use them) against ``key``."""
    return _glob_regex(glob).fullmatch(key) is not None


def _sample(template: str) -> str:
    return _PLACEHOLDER.sub(lambda m: f"x-{m.group(1)}", template)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


@cache
def _template_regex(template: str) -> re.Pattern[str]:
    out, at = [], 0
    for m in _PLACEHOLDER.finditer(template):
        out += [re.escape(template[at:m.start()]), ".+" if m.group(2) else "[^:]+"]
        at = m.end()
    return re.compile("".join([*out, re.escape(template[at:])]))


@cache
def _glob_regex(glob: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if c == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 1
        elif c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)
