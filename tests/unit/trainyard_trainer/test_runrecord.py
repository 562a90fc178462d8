"""The run record: what an attempt did, written atomically as camelCase JSON."""

import json
import sys
from pathlib import Path

import pytest
import torch

from trainyard.runrecord import (
    BatchRecord,
    Environment,
    ParallelRecord,
    ProgressRecord,
    RestoreRecord,
    RunRecord,
    ThroughputRecord,
    local_environment,
)


def record() -> RunRecord:
    return RunRecord(
        job_id="j", tenant="t", attempt=2, allocation_id="a", world_size=1, spec_hash="sha256:x", model="gpt-tiny@v1",
        num_parameters=10, dataset="d@v1",
        environment=Environment(python="3.11", torch="2", platform="linux", backend="gloo", device="cpu",
                                hostnames=["h0"], code_revision="abc"),
        batch=BatchRecord(micro_batch_size=2, data_parallel=1, grad_accumulation=2, global_batch_size=4,
                          sequence_length=8, tokens_per_step=32, spec_data_parallel=2, statement="…"),
        parallelism=ParallelRecord(dp=1, tp=1, pp=1, sharding="ddp", zero_stage=0, activation_checkpointing=False,
                                   precision="fp32", checkpoint_mode="async"),
        restore=RestoreRecord(manifest_uri="file:///m.json", global_step=4, world_size=2, reason="fell back",
                              rng="reseeded"),
        progress=ProgressRecord(start_step=4, global_step=6, consumed_tokens=192, consumed_samples=24,
                                tokens_this_attempt=64, sampler_start_position=16, sampler_position=24),
        throughput=ThroughputRecord(flops_per_token=1e6),
        loss_curve=[(5, 2.5), (6, 2.25)],
    )


def test_written_atomically_as_camel_case(tmp_path: Path) -> None:
    path = tmp_path / "attempt" / "run-record.json"
    r = record()
    r.write(path)
    data = json.loads(path.read_text())
    assert data["jobId"] == "j" and data["restore"]["rng"] == "reseeded" and data["lossCurve"] == [[5, 2.5], [6, 2.25]]
    assert data["progress"]["tokensThisAttempt"] == 64 and data["environment"]["codeRevision"] == "abc"
    assert [p.name for p in path.parent.iterdir()] == ["run-record.json"]  # no temporary file left
    again = RunRecord.model_validate_json(path.read_bytes())
    assert again.loss_curve == r.loss_curve and again.updated_at >= again.started_at


def test_local_environment() -> None:
    env = local_environment()
    assert env["python"] == sys.version.split()[0] and env["torch"] == torch.__version__
    assert env["hostname"] and env["cuda"] == torch.version.cuda
    assert env["cpu_threads"] == torch.get_num_threads()


def test_the_writers_cpu_threads_come_from_its_run_record(tmp_path: Path) -> None:
    from trainyard.runrecord import written_cpu_threads

    r = record()
    r.environment.cpu_threads = [4]
    r.write(tmp_path / "a1" / "run-record.json")
    assert written_cpu_threads(tmp_path / "a1" / "run-record.json") == [4]
    assert written_cpu_threads(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("{")
    assert written_cpu_threads(tmp_path / "bad.json") is None
    old = json.loads((tmp_path / "a1" / "run-record.json").read_text())
    del old["environment"]["cpuThreads"]  # a record written before the field
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert written_cpu_threads(tmp_path / "old.json") is None


@pytest.mark.parametrize(("written", "now", "says"), [
    (None, [2, 2], None),  # the writer's counts unknown: nothing to compare
    ([], [2], None),
    ([2, 2], [2, 2], None),
    ([4, 4], [2, 2], "written with 4 CPU threads per rank, this attempt runs 2"),
    ([2, 1], [2, 2], "written with 2/1 CPU threads per rank, this attempt runs 2"),
    ([2, 2], [2], None),  # elastic (another world size): the same count on every rank
    ([4, 4], [2], "written with 4 CPU threads per rank, this attempt runs 2"),
    ([2, 1], [1, 2], "written with 2/1 CPU threads per rank, this attempt runs 1/2"),
])
def test_a_resume_with_other_cpu_threads_is_reported(written: list[int] | None, now: list[int],
                                                     says: str | None) -> None:
    from trainyard.runrecord import cpu_threads_change

    note = cpu_threads_change(written, now)
    assert (note is None) == (says is None)
    if says is not None:
        assert note is not None and says in note and "not bitwise" in note
