"""The spec's parallelism and precision choices reach the rank; the environment only supplies defaults."""

from __future__ import annotations

import copy

import yaml

from trainyard_contract.spec import TrainingSpec
from trainyard_trainer.__main__ import apply_spec_choices
from trainyard.settings import RankSettings

EXAMPLE = yaml.safe_load(open("examples/tiny.yaml"))
RANK = dict(rank=0, world_size=2, local_rank=0, local_world_size=2, master_addr="127.0.0.1", master_port=29500,
            job_id="j", tenant="t", attempt=1, epoch=1, allocation_id="a", artifact_root="/tmp",
            allocation_file="/tmp/a.json", events_file="/tmp/e.jsonl")


def test_spec_fields_override_the_environment_defaults() -> None:
    data = copy.deepcopy(EXAMPLE)
    data["training"].update(sharding="fsdp", activationCheckpointing=True, precision="fp32")
    data["checkpointPolicy"]["mode"] = "sync"
    settings = apply_spec_choices(RankSettings(**RANK, sharding="zero1"), TrainingSpec.model_validate(data))
    assert (settings.sharding, settings.activation_checkpointing, settings.autocast, settings.checkpoint_mode) == (
        "fsdp", True, "off", "sync")


def test_unset_spec_fields_leave_the_environment_alone_and_the_hash_unchanged() -> None:
    spec = TrainingSpec.model_validate(EXAMPLE)
    env = RankSettings(**RANK, sharding="zero2", checkpoint_mode="sync")
    assert apply_spec_choices(env, spec) == env
    assert "sharding" not in spec.wire()["training"] and "mode" not in spec.wire()["checkpointPolicy"]
