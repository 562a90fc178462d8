"""Pure decisions of the node agent: is a GangAllocated ours and current, and what a rank's
environment is (the rank contract of trainyard_trainer). No I/O here."""

from __future__ import annotations

import os

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard_contract.events import GangAllocated, NodeAssignment, RankAssignment
from trainyard_contract.storage import ObjectPath


@dataclass(frozen=True)
class Launch:
    share: NodeAssignment


@dataclass(frozen=True)
class Refuse:
    reason: str


def local_share(event: GangAllocated, node_id: str) -> NodeAssignment | None:
    """This node's part of the gang, or None when the gang does not use this node."""
    return next((n for n in event.nodes if n.node_id == node_id), None)


def judge(event: GangAllocated, node_id: str, *, highest_epoch: int | None,
          lease_holders: Mapping[int, Mapping[str, Any] | None]) -> Launch | Refuse | None:
    """Launch, refuse (stale epoch or a device not leased to it), or None when not for this node.

    ``highest_epoch``: the highest epoch this node has seen for the job. ``lease_holders``:
    device index → the Redis lease holder (``{"allocationId", "epoch", …}``) or None.
    """
    share = local_share(event, node_id)
    if share is None:
        return None
    if highest_epoch is not None and event.epoch < highest_epoch:
        return Refuse(f"stale epoch {event.epoch}: epoch {highest_epoch} was already seen for job {event.job_id}")
    for slot in share.ranks:
        holder = lease_holders.get(slot.device_index)
        if holder is None:
            return Refuse(f"device {node_id}:{slot.device_index} is not leased (the allocation was released)")
        if holder.get("allocationId") != event.allocation_id:
            return Refuse(f"device {node_id}:{slot.device_index} is leased to {holder.get('allocationId')}")
    return Launch(share)


def hosts_rendezvous(share: NodeAssignment) -> bool:
    """Whether this node's part of the gang holds rank 0, whose TCPStore listens on the master port."""
    return any(slot.rank == 0 for slot in share.ranks)


def hosted_ports(event: GangAllocated, share: NodeAssignment) -> list[tuple[str, int]]:
    """The ports this node's part of the gang listens on, by what listens: rank 0's rendezvous port and, for a
    fault-tolerant job, its Lighthouse's (run by the agent of rank 0's node)."""
    if not hosts_rendezvous(share):
        return []
    ports = [("rendezvous", event.master_port)]
    if event.lighthouse_port is not None and event.spec.fault_tolerance is not None:
        ports.append(("lighthouse", event.lighthouse_port))
    return ports


def port_taken(event: GangAllocated, node_id: str, why: str, *, what: str = "rendezvous",
               port: int | None = None) -> str:
    """The ``WorkerExited.detail`` of every rank here when a port the gang listens on (``what``: rendezvous or
    lighthouse; default the master port) is already held on this node.

    The reason that goes with it is ``port-in-use`` (``trainyard_contract.exitcodes.PORT_IN_USE``): the scheduler ends
    the attempt as an interruption — no failure budget spent, no node blamed — and its next attempt draws another
    port at random (trainyard_scheduler.ports), so whoever squats a port delays a job, never fails it."""
    listener = "rank 0" if what == "rendezvous" else "the job's Lighthouse"
    return (f"{what} port {port or event.master_port} is already in use on {node_id} ({why}): another process "
            f"holds it; {listener} would fail to listen, or the ranks would reach that process. Not started; the "
            f"next attempt gets another port")


def pick_backend(setting: str, device_type: str, *, has_nvidia_smi: bool) -> str:
    """gloo for CPU devices; nccl for accelerators when the NVIDIA driver is present."""
    if setting != "auto":
        return setting
    return "nccl" if device_type != "cpu" and has_nvidia_smi else "gloo"


def cpu_thread_share(usable_cores: int, ranks_here: int, *, pinned: int | None = None) -> int:
    """Intra-op CPU threads for each of the ``ranks_here`` ranks of one attempt on this node:
    ``pinned`` when the operator set ``TRAINYARD_CPU_THREADS_PER_RANK``, else an equal share of the
    usable cores, at least one (no rank is left without a thread, none oversubscribes the others)."""
    if pinned is not None:
        return pinned
    return max(1, usable_cores // max(1, ranks_here))


def interpreter_env(base_env: Mapping[str, str], *, cpu_threads: int | None = 1,
                    extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What every rank's environment shares (the agent's own minus its settings, plus the operator's
    extras): the environment a warm interpreter imports torch in, before it knows its rank."""
    env = {k: v for k, v in base_env.items() if not k.startswith("TRAINYARD_") and k != "TRACEPARENT"}
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    if cpu_threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads))
    return env


def rank_env(
    event: GangAllocated,
    share: NodeAssignment,
    slot: RankAssignment,
    *,
    base_env: Mapping[str, str],
    backend: str,
    artifact_root: Path | ObjectPath,
    allocation_file: Path,
    events_file: Path,
    traceparent: str | None,
    cpu_threads: int | None = 1,
    extra: Mapping[str, str] | None = None,
    checkpoint_request_file: Path | None = None,
    exit_note_file: Path | None = None,
    code_env: Mapping[str, str] | None = None,
    code_dir: Path | None = None,
    scratch_dir: Path | None = None,
    interpreter_dir: Path | None = None,
    node_state_dir: Path | None = None,
    shard_cache_dir: Path | None = None,
    shard_cache_bounds: tuple[float | None, float] | None = None,
    environment: tuple[Path, str] | None = None,
    generation: int = 0,
) -> dict[str, str]:
    """The environment of one rank: the agent's own minus its TRAINYARD_* settings, then
    ``extra`` (operator knobs such as TRAINYARD_SHARDING), then the job's ``code.env`` (user code),
    then the contract, which wins (the spec already refuses a code.env that names its variables).

    ``cpu_threads`` (CPU nodes): this rank's share of the node's cores (:func:`cpu_thread_share`),
    as ``TRAINYARD_CPU_THREADS`` (the rank sets torch's intra-op threads to it, also in a warm
    interpreter that imported torch before it knew its rank) and ``OMP_NUM_THREADS`` unless set.

    ``node_state_dir``: where the rank keeps the attempt's own files (``TRAINYARD_NODE_STATE_DIR``: needed
    when the artifact root is an object store); ``shard_cache_dir``: its dataset shard cache, and
    ``shard_cache_bounds`` the cache's (size budget in GB or None, free-disk floor in GB).

    ``interpreter_dir`` (user code): put first on PATH, so the entrypoint's ``python`` (or
    ``torchrun``) is the node's training environment — torch and the SDK — not whatever the host
    calls python. ``environment`` (``code.environment``): its directory in the environment cache and its
    ``sha256:…``: first on the import path (it adds to the base; the lock cannot name torch or the SDK) and its
    scripts after the interpreter's on PATH."""
    env = {k: v for k, v in base_env.items() if not k.startswith("TRAINYARD_") and k != "TRACEPARENT"}
    env.update(extra or {})
    env.update(code_env or {})
    env.update(_contract_env(event, share, slot, backend=backend, artifact_root=artifact_root,
                             allocation_file=allocation_file, events_file=events_file))
    if event.lighthouse_port is not None:  # faultTolerance: the job's Lighthouse, and which generation this is
        env["TRAINYARD_LIGHTHOUSE"] = lighthouse_url(event.master_addr, event.lighthouse_port)
        env["TRAINYARD_REPLICA_GENERATION"] = str(generation)
    env.update(_present({
        "TRAINYARD_CHECKPOINT_REQUEST_FILE": checkpoint_request_file,
        "TRAINYARD_EXIT_NOTE_FILE": exit_note_file,
        "TRAINYARD_CODE_DIR": code_dir,
        "TRAINYARD_SCRATCH_DIR": scratch_dir,
        "TRAINYARD_NODE_STATE_DIR": node_state_dir,
        "TRAINYARD_SHARD_CACHE_DIR": shard_cache_dir,
    }))
    if shard_cache_bounds is not None:
        budget, floor = shard_cache_bounds
        if budget is not None:
            env["TRAINYARD_SHARD_CACHE_MAX_GB"] = str(budget)
        env["TRAINYARD_SHARD_CACHE_MIN_FREE_GB"] = str(floor)
    if environment is not None:
        env_dir, env_id = environment
        env["PYTHONPATH"] = os.pathsep.join([str(env_dir), *filter(None, [env.get("PYTHONPATH")])])
        env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH') or os.defpath}"
        env["TRAINYARD_ENVIRONMENT"] = env_id
    if interpreter_dir is not None:
        env["PATH"] = f"{interpreter_dir}{os.pathsep}{env.get('PATH') or os.defpath}"
    if traceparent:
        env["TRACEPARENT"] = traceparent
    if cpu_threads is not None:
        env["TRAINYARD_CPU_THREADS"] = str(cpu_threads)  # the rank's torch.set_num_threads: what its record says
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads))
    return env


def lighthouse_url(host: str, port: int) -> str:
    """The address torchft's Manager dials for the job's Lighthouse."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _contract_env(event: GangAllocated, share: NodeAssignment, slot: RankAssignment, *, backend: str,
                  artifact_root: Path | ObjectPath, allocation_file: Path, events_file: Path) -> dict[str, str]:
    """The variables every rank gets (torch.distributed's and trainyard's rank contract)."""
    return {
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(event.world_size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(len(share.ranks)),
        "MASTER_ADDR": event.master_addr,
        "MASTER_PORT": str(event.master_port),
        "TRAINYARD_BACKEND": backend,
        "TRAINYARD_DEVICE_INDEX": str(slot.device_index),
        "TRAINYARD_JOB_ID": event.job_id,
        "TRAINYARD_TENANT": event.tenant,
        "TRAINYARD_ATTEMPT": str(event.attempt),
        "TRAINYARD_EPOCH": str(event.epoch),
        "TRAINYARD_ALLOCATION_ID": event.allocation_id,
        "TRAINYARD_ARTIFACT_ROOT": str(artifact_root),
        "TRAINYARD_ALLOCATION_FILE": str(allocation_file),
        "TRAINYARD_EVENTS_FILE": str(events_file),
        "PYTHONUNBUFFERED": "1",
    }


def _present(paths: Mapping[str, Path | None]) -> dict[str, str]:
    """The variables of the optional paths that were given."""
    return {name: str(path) for name, path in paths.items() if path is not None}
