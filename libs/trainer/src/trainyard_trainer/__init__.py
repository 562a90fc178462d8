"""trainyard_trainer: what runs inside each torch rank — data, model, parallelism, the
training loop, checkpoint I/O and metrics — plus the ``trainyard-data`` dataset builder and
the ``trainyard-export`` conversion to Hugging Face model directories (:mod:`trainyard_trainer.hf`)."""

from trainyard.checkpoint import (
    Candidate,
    Checkpointer,
    CheckpointSchedule,
    RestoreChoice,
    SavedShard,
    choose_checkpoint,
    find_ready_checkpoints,
    save_checkpoint,
)
from trainyard.data import (
    STDLIB_SOURCES,
    DatasetManifest,
    ShardInfo,
    TokenDataset,
    TokenizerInfo,
    load_dataset_manifest,
    prepare_dataset,
    verify_dataset,
)
from trainyard_trainer.hf import (
    ExportListing,
    checkpoint_model_state,
    from_hf_state_dict,
    read_hf_model,
    to_hf_state_dict,
    write_hf_model,
)
from trainyard.metrics import DEVICE_PEAK_FLOPS, PeakFlops, device_peak_flops, flops_per_token, mfu
from trainyard_trainer.model import GPT, Llama, build_model
from trainyard_trainer.parallel import (
    CollectiveTimer,
    ParallelModel,
    ParallelPlan,
    apply_activation_checkpointing,
    apply_ddp,
    apply_fsdp,
    apply_tp,
    clip_grad_norm,
    parallelize,
    resolve_plan,
)
from trainyard.preemption import CheckpointRequest, StoppedOnRequest, plan_boundary
from trainyard.runrecord import RUN_RECORD_FILE, RunRecord
from trainyard.sampler import BatchLayout, GlobalSampler, batch_layout, micro_batch_seed, sample_position
from trainyard_trainer.schedule import build_lr_scheduler, lr_multiplier
from trainyard.settings import RankSettings
from trainyard.state import ModelState, OptimizerState, Progress, RngState, checkpoint_state

__all__ = [
    "DEVICE_PEAK_FLOPS",
    "GPT",
    "RUN_RECORD_FILE",
    "STDLIB_SOURCES",
    "BatchLayout",
    "Candidate",
    "CheckpointRequest",
    "CheckpointSchedule",
    "Checkpointer",
    "CollectiveTimer",
    "DatasetManifest",
    "ExportListing",
    "GlobalSampler",
    "Llama",
    "ModelState",
    "OptimizerState",
    "ParallelModel",
    "ParallelPlan",
    "PeakFlops",
    "Progress",
    "RankSettings",
    "RestoreChoice",
    "RngState",
    "RunRecord",
    "SavedShard",
    "ShardInfo",
    "StoppedOnRequest",
    "TokenDataset",
    "TokenizerInfo",
    "apply_activation_checkpointing",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "batch_layout",
    "build_lr_scheduler",
    "build_model",
    "checkpoint_model_state",
    "checkpoint_state",
    "choose_checkpoint",
    "clip_grad_norm",
    "device_peak_flops",
    "find_ready_checkpoints",
    "flops_per_token",
    "from_hf_state_dict",
    "load_dataset_manifest",
    "lr_multiplier",
    "mfu",
    "micro_batch_seed",
    "parallelize",
    "plan_boundary",
    "prepare_dataset",
    "read_hf_model",
    "resolve_plan",
    "sample_position",
    "save_checkpoint",
    "to_hf_state_dict",
    "verify_dataset",
    "write_hf_model",
]
