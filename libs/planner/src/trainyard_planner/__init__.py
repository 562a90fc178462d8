"""trainyard_planner: capacity planning math, pure (no I/O, no clock, no torch).

Do the memory arithmetic before choosing a layout. The API (submission-time checks), the
scheduler (does a gang fit), the CLI (``trainyard plan …``) and the dashboard's Lab all call this:

- :mod:`model`: a transformer's shape and exact parameter count; a model config's (:func:`transformer_for`);
- :mod:`layout`: dp x tp x pp, ZeRO stage, micro-batches, recomputation, pipeline schedule; a
  training spec's layout under a named assumption (:func:`spec_layout`);
- :mod:`memory`: model states and activations per device (ZeRO, Korthikanti et al.);
- :mod:`compute`: 6ND, PaLM's FLOPs per token, time to train, MFU, the device table, a named
  device with overrides (:func:`resolve_device`);
- :mod:`comm`: ring collectives per step over NVLink / rack / cross-rack links, the bottleneck;
- :mod:`bubble`: GPipe, 1F1B and interleaved pipeline bubbles;
- :mod:`step`: one step's time under a layout;
- :mod:`checkpoint`: size, write time, storage, Young and Daly intervals, wasted fraction;
- :mod:`recommend`: feasible layouts ranked, rejected ones explained;
- :mod:`calibrate`: correction factors per device type from measured samples;
- :mod:`lab`: the dashboard Lab's sweeps (memory vs parameters, scaling vs bandwidth, checkpoint interval).

Every result is a frozen pydantic model whose ``wire()`` is camelCase JSON
(``MemoryBreakdown.wire()["modelStatesBytesPerDevice"]``).
"""

from trainyard_planner.bubble import bubble_fraction, bubble_ratio, inflight_microbatches, layout_bubble_ratio
from trainyard_planner.calibrate import (
    Calibration, Comparison, DeviceCalibration, Sample, SampleKind, compare, fit, within,
)
from trainyard_planner.checkpoint import (
    CheckpointPlan, checkpoint_bytes, daly_interval, daly_optimal_interval, daly_wasted_fraction, job_mtbf,
    plan_checkpoint, storage_bytes, wasted_fraction, write_seconds, young_interval,
)
from trainyard_planner.comm import (
    Bottleneck, CommEstimate, LinkTier, Tier, Topology, all_gather_bytes, allreduce_bytes, allreduce_seconds,
    bottleneck, comm_to_compute_ratio, estimate_comm, reduce_scatter_bytes,
)
from trainyard_planner.compute import (
    DEVICES, DeviceSpec, FlopsCount, TrainingTime, attention_flops_per_token, cpu_device, device_spec,
    hardware_flops_per_token, hardware_training_flops, mfu, model_flops_per_token, resolve_device, training_flops,
    training_time,
)
from trainyard_planner.lab import (
    CheckpointLab, MemoryLab, ScalingLab, Sharding, checkpoint_lab, lab_topology, memory_lab, node_counts,
    scaling_lab,
)
from trainyard_planner.layout import (
    FSDP, Layout, LayoutAssumption, Recompute, Schedule, SpecLike, ZeroStage, spec_layout,
)
from trainyard_planner.memory import (
    DEFAULT_HEADROOM, FP32_ADAM, MIXED_PRECISION_ADAM, BytesPerParameter, MemoryBreakdown,
    activation_bytes_per_layer, activations_bytes_per_device, estimate_memory, model_states_bytes,
)
from trainyard_planner.model import CatalogModelLike, Transformer, transformer_for
from trainyard_planner.recommend import (
    Candidate, Recommendation, RejectedLayout, candidates, check_fits, recommend,
)
from trainyard_planner.step import DEFAULT_EFFICIENCY, StepEstimate, estimate_step

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEFAULT_HEADROOM",
    "DEVICES",
    "FP32_ADAM",
    "FSDP",
    "MIXED_PRECISION_ADAM",
    "Bottleneck",
    "BytesPerParameter",
    "Calibration",
    "Candidate",
    "CatalogModelLike",
    "CheckpointLab",
    "CheckpointPlan",
    "CommEstimate",
    "Comparison",
    "DeviceCalibration",
    "DeviceSpec",
    "FlopsCount",
    "Layout",
    "LayoutAssumption",
    "LinkTier",
    "MemoryBreakdown",
    "MemoryLab",
    "Recommendation",
    "Recompute",
    "RejectedLayout",
    "Sample",
    "SampleKind",
    "ScalingLab",
    "Schedule",
    "Sharding",
    "SpecLike",
    "StepEstimate",
    "Tier",
    "Topology",
    "TrainingTime",
    "Transformer",
    "ZeroStage",
    "activation_bytes_per_layer",
    "activations_bytes_per_device",
    "all_gather_bytes",
    "allreduce_bytes",
    "allreduce_seconds",
    "attention_flops_per_token",
    "bottleneck",
    "bubble_fraction",
    "bubble_ratio",
    "candidates",
    "check_fits",
    "checkpoint_bytes",
    "checkpoint_lab",
    "comm_to_compute_ratio",
    "compare",
    "cpu_device",
    "daly_interval",
    "daly_optimal_interval",
    "daly_wasted_fraction",
    "device_spec",
    "estimate_comm",
    "estimate_memory",
    "estimate_step",
    "fit",
    "hardware_flops_per_token",
    "hardware_training_flops",
    "inflight_microbatches",
    "job_mtbf",
    "lab_topology",
    "layout_bubble_ratio",
    "memory_lab",
    "mfu",
    "model_flops_per_token",
    "model_states_bytes",
    "node_counts",
    "plan_checkpoint",
    "recommend",
    "reduce_scatter_bytes",
    "resolve_device",
    "scaling_lab",
    "spec_layout",
    "storage_bytes",
    "training_flops",
    "training_time",
    "transformer_for",
    "wasted_fraction",
    "within",
    "write_seconds",
    "young_interval",
]
