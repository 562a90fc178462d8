"""trainyard_trainer: what runs inside each torch rank — data, model, parallelism, the
training loop, checkpoint I/O and metrics — plus the ``trainyard-data`` dataset builder."""

from trainyard_trainer.checkpoint import CheckpointSchedule, SavedShard, save_checkpoint
from trainyard_trainer.data import (
    STDLIB_SOURCES,
    DatasetManifest,
    ShardInfo,
    TokenDataset,
    TokenizerInfo,
    load_dataset_manifest,
    prepare_dataset,
    verify_dataset,
)
from trainyard_trainer.model import GPT, build_model
from trainyard_trainer.parallel import CollectiveTimer, apply_ddp
from trainyard_trainer.sampler import GlobalSampler, sample_position
from trainyard_trainer.schedule import build_lr_scheduler, lr_multiplier
from trainyard_trainer.settings import RankSettings
from trainyard_trainer.state import ModelState, OptimizerState, Progress, RngState, checkpoint_state

__all__ = [
    "GPT",
    "STDLIB_SOURCES",
    "CheckpointSchedule",
    "CollectiveTimer",
    "DatasetManifest",
    "GlobalSampler",
    "ModelState",
    "OptimizerState",
    "Progress",
    "RankSettings",
    "RngState",
    "SavedShard",
    "ShardInfo",
    "TokenDataset",
    "TokenizerInfo",
    "apply_ddp",
    "build_lr_scheduler",
    "build_model",
    "checkpoint_state",
    "load_dataset_manifest",
    "lr_multiplier",
    "prepare_dataset",
    "sample_position",
    "save_checkpoint",
    "verify_dataset",
]
