from pathlib import Path

import pytest
import torch

from trainyard_contract import exitcodes
from trainyard_contract.errors import (
    CheckpointCorruptError,
    ConfigError,
    DataError,
    InfrastructureError,
    UnknownReferenceError,
)
from trainyard_contract.events import GangAllocated, NodeAssignment, RankAssignment
from trainyard_contract.settings import load_settings
from trainyard_contract.spec import TrainingSpec
from trainyard_trainer.__main__ import exit_code_for, main, read_allocation
from trainyard.runtime import Runtime
from trainyard.settings import RankSettings
from trainyard_trainer.training import NonFiniteError, resolve_job


@pytest.mark.parametrize(("exc", "code"), [
    (NonFiniteError("nan"), exitcodes.NAN),
    (CheckpointCorruptError("bad shard"), exitcodes.CHECKPOINT),
    (DataError("bad shard"), exitcodes.DATA),
    (ConfigError("x"), exitcodes.CONFIG),
    (UnknownReferenceError("modelConfig", "nope"), exitcodes.CONFIG),
    (torch.OutOfMemoryError("oom"), exitcodes.OOM),
    (InfrastructureError("disk"), exitcodes.ERROR),
    (RuntimeError("gloo timeout"), exitcodes.ERROR),
])
def test_exit_codes(exc: BaseException, code: int) -> None:
    assert exit_code_for(exc) == code


ENV = {
    "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "::1", "MASTER_PORT": "29500",
    "TRAINYARD_JOB_ID": "j1", "TRAINYARD_TENANT": "acme", "TRAINYARD_ATTEMPT": "2", "TRAINYARD_EPOCH": "5",
    "TRAINYARD_ALLOCATION_ID": "a1", "TRAINYARD_ARTIFACT_ROOT": "/tmp/a", "TRAINYARD_ALLOCATION_FILE": "/tmp/a.json",
    "TRAINYARD_EVENTS_FILE": "/tmp/e.jsonl", "TRACEPARENT": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
}


def test_settings_parse_the_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    s = load_settings(RankSettings)
    assert (s.rank, s.world_size, s.attempt, s.epoch, s.backend) == (1, 2, 2, 5, None)
    assert s.init_method == "tcp://[::1]:29500"
    assert s.traceparent == ENV["TRACEPARENT"]


def test_missing_or_inconsistent_variables_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TRAINYARD_JOB_ID")
    with pytest.raises(ConfigError, match="TRAINYARD_JOB_ID"):
        load_settings(RankSettings)
    monkeypatch.setenv("TRAINYARD_JOB_ID", "j1")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ConfigError, match="not below WORLD_SIZE"):
        load_settings(RankSettings)
    assert main([]) == exitcodes.CONFIG


def test_help_names_every_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ENV)


def spec(**training: object) -> TrainingSpec:
    return TrainingSpec.model_validate({
        "specVersion": "v1", "modelConfig": training.pop("model", "gpt-tiny@v1"), "dataset": "tinycorpus@v1",
        "codeRevision": "x", "resources": {"gpuType": "cpu", "gpuCount": training.pop("gpus", 2)},
        "parallelism": training.pop("parallelism", {"data": 2}),
        "training": {"sequenceLength": 64, "microBatchSize": 2, "globalBatchSize": 8, "learningRate": 1e-3,
                     "maxSteps": 4, **training},
    })


def allocation(s: TrainingSpec, **kw: object) -> GangAllocated:
    fields = dict(job_id="j1", tenant="acme", attempt=2, allocation_id="a1", epoch=5, world_size=2,
                  master_addr="127.0.0.1", master_port=29500, spec=s, spec_hash=s.spec_hash(),
                  nodes=[NodeAssignment(node_id="n", host="h",
                                        ranks=[RankAssignment(rank=0, local_rank=0, device_index=0)])])
    fields.update(kw)
    return GangAllocated(**fields)


def settings() -> RankSettings:
    return RankSettings.model_validate(ENV)


CPU = Runtime(torch.device("cpu"), "gloo", None)


def test_resolve_job_accepts_a_consistent_allocation() -> None:
    job = resolve_job(settings(), allocation(spec()), CPU)
    assert job.model_config.d_model == 64 and job.dp == 2 and job.tokens_per_step == 8 * 64
    assert job.batch is not None and job.batch.grad_accumulation == 2


def test_resolve_job_takes_the_dp_size_from_the_world() -> None:
    """Elastic: a world of 4 for a spec written for 2 keeps the global batch with less accumulation."""
    s = settings().model_copy(update={"world_size": 4})
    job = resolve_job(s, allocation(spec(), world_size=4), CPU)
    assert (job.dp, job.batch.grad_accumulation, job.batch.spec_dp) == (4, 1, 2)
    assert "the spec asked for parallelism.data 2" in job.batch.statement()


def test_resolve_job_refuses_a_world_that_cannot_keep_the_global_batch() -> None:
    s = settings().model_copy(update={"world_size": 3})
    with pytest.raises(ConfigError, match="globalBatchSize 8 is not a multiple of microBatchSize 2 x data-parallel "
                                          "size 3 = 6"):
        resolve_job(s, allocation(spec(), world_size=3), CPU)


def test_resolve_job_reads_the_parallel_settings() -> None:
    s = settings().model_copy(update={"local_world_size": 2, "sharding": "zero2", "activation_checkpointing": True})
    job = resolve_job(s, allocation(spec(parallelism={"data": 1, "tensor": 2})), CPU)
    assert (job.plan.dp, job.plan.tp, job.plan.pp, job.plan.sharding) == (1, 2, 1, "zero2")
    assert job.plan.activation_checkpointing


@pytest.mark.parametrize(("alloc", "message"), [
    (allocation(spec(), attempt=3), "attempt 3"),
    (allocation(spec(), world_size=4), "world size 4"),
    (allocation(spec(parallelism={"data": 1, "tensor": 2}), world_size=2), "inside one node"),
    (allocation(spec(model="gpt-huge@v9")), "unknown model"),
    (allocation(spec(sequenceLength=256)), "maxSeqLen 128"),
])
def test_resolve_job_refuses(alloc: GangAllocated, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_job(settings(), alloc, CPU)


def test_read_allocation(tmp_path: Path) -> None:
    path = tmp_path / "alloc.json"
    s = settings().model_copy(update={"allocation_file": path})
    with pytest.raises(ConfigError, match="does not exist"):
        read_allocation(s)
    path.write_text('{"eventType": "GangAllocated"}')
    with pytest.raises(ConfigError, match="not a GangAllocated"):
        read_allocation(s)
    expected = allocation(spec())
    path.write_bytes(expected.to_bytes())
    assert read_allocation(s) == expected
