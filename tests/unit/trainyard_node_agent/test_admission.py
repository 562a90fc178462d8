"""The node agent's pure decisions: fencing of GangAllocated, backend choice, the rank environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_contract.events import GangAllocated, NodeAssignment, RankAssignment
from trainyard_contract.spec import TrainingSpec
from trainyard_node_agent.admission import Launch, Refuse, judge, pick_backend, rank_env
from trainyard_node_agent.settings import NodeAgentSettings

SPEC = TrainingSpec.model_validate({
    "specVersion": "v1", "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "codeRevision": "t",
    "resources": {"gpuType": "cpu", "gpuCount": 3}, "parallelism": {"data": 3},
    "checkpointPolicy": {"everySteps": 10},
    "training": {"sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 3, "learningRate": 0.001,
                 "maxSteps": 20},
})


def gang(epoch: int = 5, allocation_id: str = "alloc-5") -> GangAllocated:
    return GangAllocated(
        job_id="j1", tenant="t1", attempt=2, allocation_id=allocation_id, epoch=epoch, world_size=3,
        nodes=[
            NodeAssignment(node_id="a", host="10.0.0.1", ranks=[RankAssignment(rank=0, local_rank=0, device_index=0),
                                                               RankAssignment(rank=1, local_rank=1, device_index=1)]),
            NodeAssignment(node_id="b", host="10.0.0.2", ranks=[RankAssignment(rank=2, local_rank=0, device_index=3)]),
        ],
        master_addr="10.0.0.1", master_port=29411, spec=SPEC, spec_hash=SPEC.spec_hash(),
    )


def holders(allocation_id: str = "alloc-5", *indices: int) -> dict[int, dict[str, object]]:
    return {i: {"allocationId": allocation_id, "jobId": "j1", "epoch": 5} for i in (indices or (0, 1, 3))}


def test_launches_its_own_share_when_current_and_leased() -> None:
    decision = judge(gang(), "b", highest_epoch=4, lease_holders=holders())
    assert isinstance(decision, Launch)
    assert [r.rank for r in decision.share.ranks] == [2]
    assert judge(gang(), "a", highest_epoch=None, lease_holders=holders()) == Launch(gang().nodes[0])


def test_not_for_this_node() -> None:
    assert judge(gang(), "c", highest_epoch=None, lease_holders={}) is None


@pytest.mark.parametrize(("highest", "leases", "fragment"), [
    (6, holders(), "stale epoch 5: epoch 6 was already seen for job j1"),
    (None, {0: None, 1: None}, "device a:0 is not leased (the allocation was released)"),
    (5, holders("alloc-other"), "device a:0 is leased to alloc-other"),
])
def test_refuses(highest: int | None, leases: dict, fragment: str) -> None:
    decision = judge(gang(), "a", highest_epoch=highest, lease_holders=leases)
    assert isinstance(decision, Refuse) and decision.reason == fragment


@pytest.mark.parametrize(("setting", "device", "smi", "expected"), [
    ("auto", "cpu", True, "gloo"),
    ("auto", "h100-80gb", True, "nccl"),
    ("auto", "h100-80gb", False, "gloo"),
    ("nccl", "cpu", False, "nccl"),
])
def test_backend(setting: str, device: str, smi: bool, expected: str) -> None:
    assert pick_backend(setting, device, has_nvidia_smi=smi) == expected


def test_rank_env_is_the_trainer_contract(tmp_path: Path) -> None:
    event = gang()
    share = event.nodes[0]
    base = {"PATH": "/usr/bin", "TRAINYARD_NODE_ID": "a", "TRACEPARENT": "old", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"}
    env = rank_env(event, share, share.ranks[1], base_env=base, backend="gloo", artifact_root=tmp_path,
                   allocation_file=tmp_path / "alloc.json", events_file=tmp_path / "rank-1.jsonl",
                   traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
                   extra={"TRAINYARD_SHARDING": "fsdp", "RANK": "99"})
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} \
        == {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29411"}
    assert env["TRAINYARD_DEVICE_INDEX"] == "1" and env["TRAINYARD_BACKEND"] == "gloo"
    assert (env["TRAINYARD_JOB_ID"], env["TRAINYARD_TENANT"], env["TRAINYARD_ATTEMPT"], env["TRAINYARD_EPOCH"],
            env["TRAINYARD_ALLOCATION_ID"]) == ("j1", "t1", "2", "5", "alloc-5")
    assert env["TRAINYARD_ALLOCATION_FILE"] == str(tmp_path / "alloc.json")
    assert env["TRAINYARD_EVENTS_FILE"] == str(tmp_path / "rank-1.jsonl")
    assert env["TRAINYARD_ARTIFACT_ROOT"] == str(tmp_path)
    assert env["TRACEPARENT"].startswith("00-aaaa")
    assert "TRAINYARD_NODE_ID" not in env  # the agent's own settings do not leak into ranks
    assert env["TRAINYARD_SHARDING"] == "fsdp"  # operator knobs do, explicitly; the contract still wins:
    assert env["PATH"] == "/usr/bin" and env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "x" and env["OMP_NUM_THREADS"] == "1"


def test_settings_accept_a_json_list_or_a_shell_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_RANK_ENV", '{"TRAINYARD_SHARDING": "zero1"}')
    assert NodeAgentSettings(node_id="n").rank_env == {"TRAINYARD_SHARDING": "zero1"}
    assert NodeAgentSettings(node_id="n", rank_command='["python", "w.py"]').rank_command == ["python", "w.py"]
    shell = NodeAgentSettings(node_id="n", rank_command="python 'my w.py' -v")
    assert shell.rank_command == ["python", "my w.py", "-v"]
    assert NodeAgentSettings(node_id="n").rank_command[1:] == ["-m", "trainyard_trainer"]


def test_interpreter_env_is_the_shared_part_of_every_rank_env() -> None:
    from trainyard_node_agent.admission import interpreter_env

    base = {"PATH": "/bin", "TRAINYARD_REDIS_URL": "redis://secret", "TRACEPARENT": "00-x", "HOME": "/root"}
    env = interpreter_env(base, cpu_threads=1, extra={"TRAINYARD_SHARDING": "fsdp"})
    assert env == {"PATH": "/bin", "HOME": "/root", "TRAINYARD_SHARDING": "fsdp", "PYTHONUNBUFFERED": "1",
                   "OMP_NUM_THREADS": "1"}
    assert "OMP_NUM_THREADS" not in interpreter_env(base, cpu_threads=None)


@pytest.mark.parametrize(("cores", "ranks", "pinned", "share"), [
    (16, 1, None, 16),  # one rank: the whole node
    (16, 4, None, 4),
    (16, 3, None, 5),  # the remainder stays idle rather than oversubscribe a rank
    (2, 2, None, 1),
    (2, 4, None, 1),  # more ranks than cores: still one thread each
    (1, 0, None, 1),
    (16, 4, 2, 2),  # TRAINYARD_CPU_THREADS_PER_RANK pins it
    (2, 1, 8, 8),
])
def test_each_rank_gets_its_share_of_the_cores(cores: int, ranks: int, pinned: int | None, share: int) -> None:
    from trainyard_node_agent.admission import cpu_thread_share

    assert cpu_thread_share(cores, ranks, pinned=pinned) == share


def test_rank_env_carries_the_thread_share(tmp_path: Path) -> None:
    event = gang()
    share = event.nodes[0]
    env = rank_env(event, share, share.ranks[0], base_env={"OMP_NUM_THREADS": "3"}, backend="gloo",
                   artifact_root=tmp_path, allocation_file=tmp_path / "a.json", events_file=tmp_path / "e.jsonl",
                   traceparent=None, cpu_threads=4)
    assert env["TRAINYARD_CPU_THREADS"] == "4"  # what the rank sets torch to
    assert env["OMP_NUM_THREADS"] == "3"  # an operator's own OpenMP setting is left alone
    none = rank_env(event, share, share.ranks[0], base_env={}, backend="nccl", artifact_root=tmp_path,
                    allocation_file=tmp_path / "a.json", events_file=tmp_path / "e.jsonl", traceparent=None,
                    cpu_threads=None)
    assert "TRAINYARD_CPU_THREADS" not in none and "OMP_NUM_THREADS" not in none
    assert NodeAgentSettings(node_id="n", cpu_threads_per_rank=2).cpu_threads_per_rank == 2
