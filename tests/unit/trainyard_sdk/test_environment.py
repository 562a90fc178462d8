"""The rank environment, outside trainyard, local mode, the loader and the timers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainyard
from trainyard.environment import local_settings, missing_rank_variables, read_allocation
from trainyard.timing import Timing
from trainyard_contract import exitcodes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timers_nest_and_the_window_resets() -> None:
    clock = Clock()
    timing = Timing(clock=clock)
    with timing.data():
        clock.now += 1
    with timing.compute():
        clock.now += 2
        with timing.collective():
            clock.now += 3
        clock.now += 4
    timing.add(checkpoint=0.5)
    times = timing.take()
    assert (times.data_wait, times.compute, times.collective, times.checkpoint) == (1, 6, 3, 0.5)
    assert timing.take().compute == 0


def test_outside_trainyard_init_says_what_is_missing_and_exits_config(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TRAINYARD_JOB_ID", "TRAINYARD_LOCAL",
                 "TRAINYARD_ALLOCATION_FILE", "TRAINYARD_EVENTS_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exited:
        trainyard.init()
    assert exited.value.code == exitcodes.CONFIG
    err = capsys.readouterr().err
    assert "not running under trainyard" in err and "TRAINYARD_JOB_ID" in err and "TRAINYARD_LOCAL=1" in err


def test_missing_rank_variables() -> None:
    assert missing_rank_variables({}) == ["RANK", "WORLD_SIZE", "MASTER_PORT", "TRAINYARD_JOB_ID",
                                          "TRAINYARD_ALLOCATION_FILE", "TRAINYARD_EVENTS_FILE"]


def test_local_mode_writes_an_allocation_as_the_agent_would(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        "specVersion: v1\nmodelConfig: gpt-tiny@v1\ndataset: tinycorpus@v1\ncodeRevision: x\n"
        "code: {entrypoint: [python, train.py]}\n"  # no archive yet: filled in at submission, ignored locally
        "resources: {gpuType: cpu, gpuCount: 1}\n"
        "training: {sequenceLength: 8, microBatchSize: 2, globalBatchSize: 4, learningRate: 0.01, maxSteps: 3}\n")
    settings = local_settings(spec=str(spec_file), root=tmp_path / "art", environ={})
    assert (settings.rank, settings.world_size, settings.tenant) == (0, 1, "local")
    allocation = read_allocation(settings)
    assert allocation.world_size == 1 and allocation.spec.training.max_steps == 3 and allocation.spec.code is None


def test_local_mode_without_a_spec_is_a_config_error_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(trainyard.ConfigError, match="TRAINYARD_LOCAL_SPEC"):
        local_settings(spec=str(tmp_path / "nope.yaml"), root=tmp_path, environ={})


def test_the_loader_resumes_where_it_was(tmp_path: Path) -> None:
    from trainyard.data import STDLIB_SOURCES, prepare_dataset
    from trainyard.sampler import GlobalSampler
    from trainyard.data import TokenDataset
    import torch

    prepare_dataset(tmp_path, "d", "v1", sources=STDLIB_SOURCES[:2])
    dataset = TokenDataset(tmp_path / "datasets" / "d" / "v1" / "manifest.json", 8)

    def loader() -> trainyard.DataLoader:
        sampler = GlobalSampler(len(dataset), seed=1, global_batch=4, micro_batch=2, dp=1, dp_rank=0)
        return trainyard.DataLoader(dataset, sampler, torch.device("cpu"))

    first = loader()
    next(first)
    saved = json.loads(json.dumps(first.state_dict()))
    expected = next(first)
    second = loader()
    second.load_state_dict(saved)
    got = next(second)
    assert len(got) == first.grad_accumulation == 2
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, expected, strict=True))


def test_an_object_store_root_needs_a_node_state_dir_for_the_attempts_own_files(tmp_path: Path) -> None:
    from trainyard.environment import checkpoint_request_file
    from trainyard.settings import RankSettings

    contract = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500", "TRAINYARD_JOB_ID": "j",
                "TRAINYARD_TENANT": "t",
                "TRAINYARD_ATTEMPT": "2", "TRAINYARD_EPOCH": "1", "TRAINYARD_ALLOCATION_ID": "a",
                "TRAINYARD_ALLOCATION_FILE": str(tmp_path / "a.json"), "TRAINYARD_EVENTS_FILE": str(tmp_path / "e")}
    local = RankSettings.model_validate({**contract, "TRAINYARD_ARTIFACT_ROOT": str(tmp_path / "art")})
    assert local.local_root == tmp_path / "art" and local.shard_cache_path == tmp_path / "art" / "shard-cache"
    with pytest.raises(ValueError, match="TRAINYARD_NODE_STATE_DIR"):
        RankSettings.model_validate({**contract, "TRAINYARD_ARTIFACT_ROOT": "s3://bucket/prefix"})
    remote = RankSettings.model_validate({**contract, "TRAINYARD_ARTIFACT_ROOT": "s3://bucket/prefix",
                                          "TRAINYARD_NODE_STATE_DIR": str(tmp_path / "node")})
    assert remote.artifact_root == "s3://bucket/prefix" and remote.local_root == tmp_path / "node"
    assert checkpoint_request_file(remote) == tmp_path / "node/tenants/t/jobs/j/attempts/2/checkpoint-request.json"


def test_local_mode_under_an_object_store_root_keeps_the_attempt_on_this_machine(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        "specVersion: v1\nmodelConfig: gpt-tiny@v1\ndataset: tinycorpus@v1\ncodeRevision: x\n"
        "resources: {gpuType: cpu, gpuCount: 1}\n"
        "training: {sequenceLength: 8, microBatchSize: 2, globalBatchSize: 4, learningRate: 0.01, maxSteps: 3}\n")
    settings = local_settings(spec=str(spec_file), root="s3://bucket/prefix",
                              environ={"TRAINYARD_NODE_STATE_DIR": str(tmp_path / "node")})
    assert settings.artifact_root == "s3://bucket/prefix"
    assert settings.allocation_file.is_relative_to(tmp_path / "node") and settings.allocation_file.is_file()
