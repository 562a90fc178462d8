"""Node agent settings (``TRAINYARD_*``), parsed once in ``main()``."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from trainyard_contract.settings import ServiceSettings

DEFAULT_NODE_STATE_DIR = Path(".trainyard/node-state")


class NodeAgentSettings(ServiceSettings):
    """One node: its identity, its devices and how ranks are launched on it."""

    node_id: str = Field(min_length=1, max_length=128, description="this node's id (unique in the cluster)")
    host: str = Field(default="127.0.0.1", description="address other nodes reach this one at (rendezvous)")
    device_count: int = Field(default=4, ge=0, le=1024, description="devices this node offers")
    device_type: str = Field(default="cpu", min_length=1, description="device type, matched to resources.gpuType")
    device_memory_bytes: int = Field(default=16 * 2**30, ge=0, description="memory per device (reported)")
    rack: str | None = Field(default=None, description="rack, for topology-aware placement")
    nvlink_domain: str | None = Field(
        default=None,
        description="NVLink / NVSwitch domain of the devices: unset = this node alone; the same name on "
                    "several nodes = one multi-node domain (NVL72-class); tensor-parallel groups stay inside one",
    )
    network_tier: str | None = Field(
        default=None, description="network block above the rack (pod / spine group), for topology-aware placement"
    )
    heartbeat_s: float = Field(default=2.0, gt=0, description="seconds between NodeHeartbeats")
    rank_command: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [sys.executable, "-m", "trainyard_trainer"],
        description="command run once per rank: a JSON list or a shell-quoted string",
    )
    rank_env: dict[str, str] = Field(
        default_factory=dict,
        description='extra environment for every rank, JSON (e.g. {"TRAINYARD_CHECKPOINT_MODE": "sync"}); '
                    "the agent's own TRAINYARD_* variables are not passed on",
    )
    kill_grace_s: float = Field(default=10.0, ge=0, description="SIGTERM → SIGKILL grace when stopping ranks")
    drain_timeout_s: float = Field(
        default=120.0, ge=0,
        description="on SIGTERM the agent drains first: it asks its running ranks to checkpoint at an agreed step "
                    "and stop (the pause protocol), and waits up to this long before stopping what still runs "
                    "(0 = stop at once)",
    )
    kube_node_name: str | None = Field(
        default=None,
        description="in Kubernetes, this node's name (downward API spec.nodeName): a cordon or `kubectl drain` "
                    "of the node drains it in trainyard too (its attempts checkpoint and stop, nothing new is "
                    "placed), an uncordon ends that drain; unset = no watch",
    )
    kube_api_url: str = Field(default="https://kubernetes.default.svc", description="the Kubernetes API server")
    kube_token_file: Path = Field(default=Path("/var/run/secrets/kubernetes.io/serviceaccount/token"),
                                  description="service-account token for the Kubernetes API")
    kube_ca_file: Path = Field(default=Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"),
                               description="CA bundle of the Kubernetes API server")
    kube_poll_s: float = Field(default=10.0, gt=0, description="how often the Node object is read")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="torch.distributed backend; auto: nccl when nvidia-smi exists and devices are not cpu",
    )
    spool_poll_s: float = Field(default=0.25, gt=0, description="how often rank event spools are relayed")
    log_ship_interval_s: float = Field(
        default=2.0, gt=0,
        description="with an object-store artifact root: how often a running rank's new log lines are shipped to "
                    "the store (one object per shipment; the API reads them there). Under a directory root the "
                    "API reads the log file itself")
    hang_timeout_s: float = Field(
        default=300.0, gt=0,
        description="an attempt whose rank here wrote no event (StepMetrics, ShardWritten) for this long is "
                    "hung: all its ranks on this node are killed and reported with reason 'hang'; for user code "
                    "(spec.code) output to the rank's log counts as progress too",
    )
    first_step_timeout_s: float = Field(
        default=900.0, gt=0,
        description="the same, before a rank's first event (start-up, rendezvous and restore take longer); "
                    "a plain script of user code that never reports must print at least this often",
    )
    lease_check_s: float = Field(
        default=5.0, gt=0,
        description="how often running ranks are checked against their device leases in Redis; a rank whose "
                    "allocation no longer holds its device is stopped (a revocation that never arrived)",
    )
    confirm_interval_s: float = Field(
        default=5.0, gt=0,
        description="how often announced events (WorkerStarted, WorkerExited, ShardWritten) are checked against "
                    "Redis for having been applied, and published again if not (a broker can lose messages)",
    )
    confirm_after_s: float = Field(default=10.0, gt=0, description="how long an announcement may take to be applied")
    confirm_max_age_s: float = Field(default=3600.0, gt=0, description="after this, an announcement is given up")
    cpu_threads_per_rank: int | None = Field(
        default=None, ge=1,
        description="intra-op CPU threads of each rank on a CPU node; unset = the usable cores (CPU affinity) "
                    "divided by the ranks of the attempt on this node, at least 1",
    )
    warm_ranks: int | None = Field(
        default=None, ge=0, le=1024,
        description="interpreters kept ready with the trainer already imported (a new attempt's ranks start "
                    "in one instead of a cold python: seconds faster); each holds the memory of an imported "
                    "torch (~330 MB on CPU). Unset: one per device, as many as an eighth of the memory available "
                    "at start holds at 512 MiB each (warmpool.auto_size); 0 = off. On a sandboxed node a warm "
                    "interpreter enters the rank's sandbox when it becomes the rank",
    )
    warm_refill_quiet_s: float = Field(
        default=5.0, ge=0,
        description="the warm pool is refilled only once no rank of this node has started or ended for this long",
    )
    warm_module: str = Field(
        default="trainyard_trainer.__main__",
        description="the module a warm interpreter imports in advance; its main() is the rank",
    )
    code_cache_dir: Path | None = Field(
        default=None,
        description="where users' code trees are extracted, one read-only entry per archive hash, shared by "
                    "attempts and jobs (default: <agent state dir>/code-cache)",
    )
    code_cache_max_bytes: int = Field(
        default=10 * 2**30, ge=0,
        description="the code cache is kept under this size: least recently used trees no running rank "
                    "uses are removed first",
    )
    env_cache_dir: Path | None = Field(
        default=None,
        description="where jobs' environments (code.environment) are built, one read-only entry per lock hash, "
                    "shared by attempts, jobs and agents (default: <agent state dir>/env-cache)",
    )
    env_cache_max_bytes: int = Field(
        default=20 * 2**30, ge=0,
        description="the environment cache is kept under this size: least recently used environments no "
                    "running rank uses are removed first",
    )
    env_index_url: str | None = Field(
        default=None,
        description="the package index jobs' environments are installed from (uv --index-url; default: uv's "
                    "own, i.e. UV_INDEX_URL in the agent's environment, else PyPI). A lock cannot choose it",
    )
    env_find_links: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="directories or URLs of wheels jobs' environments may also come from (uv --find-links), "
                    "comma-separated",
    )
    env_no_index: bool = Field(
        default=False, description="install jobs' environments from env_find_links only (uv --no-index)")
    env_build_timeout_s: float = Field(
        default=1800.0, gt=0,
        description="how long building one environment may take before its ranks here fail (error, retried)",
    )
    node_sandbox: Literal["enforce", "trusted-single-tenant"] = Field(
        default="enforce",
        description="enforce: every rank runs as its job's own unprivileged user in a mount namespace that shows "
                    "only its code, datasets, checkpoint prefix and attempt directory (the agent refuses to start "
                    "where that cannot be done: it needs root); trusted-single-tenant: ranks run as the agent's "
                    "user and see the whole artifact root, for a node that only runs one tenant's trusted code",
    )
    sandbox_first_uid: int = Field(
        default=1_000_000_000, ge=1000, le=2**32 - 2**21,
        description="the first uid (and gid) of the range jobs' ranks run as (a job's is a hash of its id into "
                    "the range, the same on every node); no user of the host may own one",
    )
    sandbox_uid_count: int = Field(default=2**20, ge=1, le=2**21, description="how many uids that range holds")
    node_rank_blocked: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="endpoints sandboxed ranks may not connect to (TCP and UDP), comma-separated host:port: the "
                    "control plane (the broker, Redis and its Sentinels, the API, the services' metrics ports, the "
                    "OTLP collector, Prometheus, an S3 endpoint). A loopback or wildcard host means any address of "
                    "this node, * any destination, a CIDR a network, a port may be a range lo-hi; the agent's own "
                    "metrics port is added. Enforced by nftables rules on the job uid range (rank_network.py): under "
                    "enforce the agent refuses to start when it cannot install them; empty: ranks reach everything "
                    "(a warning). `make up` lists every endpoint of the local stack",
    )
    agent_state_file: Path | None = Field(
        default=None,
        description="node-local copy of the rank table, read at start-up when Redis is down "
                    "(default: <node state dir>/nodes/<node_id>/agent-ranks.json)",
    )
    node_state_dir: Path | None = Field(
        default=None,
        description="this node's own files: each attempt's directory (rank logs, event spools, exit notes, run "
                    "records, checkpoint requests), the rank table, the code and shard caches. Default: the "
                    "artifact root when it is a directory (nothing moves); with an object-store artifact root, "
                    f"{DEFAULT_NODE_STATE_DIR}",
    )
    shard_cache_dir: Path | None = Field(
        default=None,
        description="where ranks keep verified copies of dataset shards they read from an object store, shared "
                    "by this node's ranks (TRAINYARD_SHARD_CACHE_DIR of each rank; default: <agent state "
                    "dir>/shard-cache). On a sandboxed node each rank caches in its own scratch directory instead",
    )
    shard_cache_max_gb: float | None = Field(
        default=None, gt=0,
        description="size budget of the shard cache in GB (1e9 bytes), passed to each rank "
                    "(TRAINYARD_SHARD_CACHE_MAX_GB): least recently used shards are deleted to stay within it. "
                    "Default: no budget; shards are deleted only to keep shard_cache_min_free_gb free",
    )
    shard_cache_min_free_gb: float = Field(
        default=1.0, ge=0,
        description="free disk in GB the shard cache leaves on its filesystem (TRAINYARD_SHARD_CACHE_MIN_FREE_GB of "
                    "each rank)",
    )
    rank_pass_env: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="names of variables of the agent's environment passed on to ranks although they look "
                    "secret (scrubbed otherwise), comma-separated: e.g. AWS_ACCESS_KEY_ID,AWS_SECRET_ACCESS_KEY,"
                    "AWS_DEFAULT_REGION,AWS_ENDPOINT_URL_S3 for ranks that write checkpoints to an object store "
                    "without an instance role. Every rank on the node can then read them",
    )

    sandbox_hide: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="more directories a sandboxed rank must not see, comma-separated, besides the artifact root, "
                    "the caches, the agent's state and its user's home: e.g. a local stack's whole state directory "
                    "(Redis' data, tokens), which `make up` passes",
    )

    attempt_pids_max: int | None = Field(
        default=4096, ge=16,
        description="on a sandboxed node, the most processes and threads one attempt's ranks may have on this node "
                    "together (its cgroup's pids.max; a fork bomb stops there); unset = no limit",
    )
    attempt_memory_bytes: int | None = Field(
        default=None, ge=64 * 2**20,
        description="on a sandboxed node, the memory one attempt's ranks may use on this node together (its "
                    "cgroup's memory.max / memory.limit_in_bytes; past it the kernel OOM-kills a rank, reported "
                    "as oom); unset = no limit",
    )
    attempt_cpu_cores: float | None = Field(
        default=None, gt=0,
        description="on a sandboxed node, the CPU time one attempt's ranks may use on this node, in cores (its "
                    "cgroup's cpu.max / cpu.cfs_quota_us); unset = no quota",
    )
    attempt_shm_bytes: int = Field(
        default=2**30, ge=2**20,
        description="on a sandboxed node, the size of the private /dev/shm each attempt's ranks on this node share "
                    "(a tmpfs of the agent's, counted against the attempt's memory; gone when the attempt ends)",
    )

    @field_validator("sandbox_hide", mode="before")
    @classmethod
    def _paths(cls, value: object) -> object:
        if isinstance(value, str):
            return [Path(p.strip()) for p in value.split(",") if p.strip()]
        return value

    @property
    def local_root(self) -> Path:
        """The root of this node's own files (:attr:`node_state_dir`, resolved)."""
        if self.node_state_dir is not None:
            return self.node_state_dir.expanduser().resolve()
        if self.artifact_root_is_remote:
            return DEFAULT_NODE_STATE_DIR.resolve()
        return self.artifact_root_abs

    @property
    def agent_state_path(self) -> Path:
        return self.agent_state_file or self.local_root / "nodes" / self.node_id / "agent-ranks.json"

    @property
    def shard_cache_path(self) -> Path:
        return self.shard_cache_dir or self.agent_state_path.parent / "shard-cache"

    @property
    def code_cache_path(self) -> Path:
        return self.code_cache_dir or self.agent_state_path.parent / "code-cache"

    @property
    def env_cache_path(self) -> Path:
        return self.env_cache_dir or self.agent_state_path.parent / "env-cache"

    @field_validator("rank_pass_env", "env_find_links", mode="before")
    @classmethod
    def _names(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [n.strip() for n in text.split(",") if n.strip()]
        return value

    @field_validator("node_rank_blocked", mode="before")
    @classmethod
    def _endpoints(cls, value: object) -> object:
        from trainyard_node_agent.rank_network import parse_entries  # "[::1]:6379" is an entry, not JSON

        if isinstance(value, str):
            value = value.split(",")
        return [str(t) for t in parse_entries(value)] if isinstance(value, list) else value

    @field_validator("rank_command", mode="before")
    @classmethod
    def _command(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            parsed = json.loads(text) if text.startswith("[") else shlex.split(text)
            if not parsed:
                raise ValueError("rank_command must not be empty")
            return parsed
        return value
