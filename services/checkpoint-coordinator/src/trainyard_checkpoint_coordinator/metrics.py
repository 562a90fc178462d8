"""Prometheus metrics of the coordinator (served when ``TRAINYARD_METRICS_PORT`` is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

CHECKPOINTS = Counter(
    "trainyard_checkpoints_total", "Checkpoints settled by the coordinator", ["outcome"]
)
SHARDS = Counter(
    "trainyard_checkpoint_shard_reports_total", "Shard reports received, by verdict", ["verdict"]
)
REFUSED = Counter(
    "trainyard_checkpoint_security_refusals_total",
    "Shard reports refused (not the job's tenant, or a file outside the job's checkpoint directory) and "
    "manifests not committed (the step directory swapped for a link)",
)
VERIFY_SECONDS = Histogram(
    "trainyard_checkpoint_verify_seconds", "Time to verify every shard's size and sha256",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900),
)
CHECKPOINT_BYTES = Histogram(
    "trainyard_checkpoint_bytes", "Size of READY checkpoints (all shards and shared files)",
    buckets=(1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13),
)
GC = Counter(
    "trainyard_checkpoint_gc_total",
    "Checkpoint files removed: retired (READY beyond keepLast), collected (FAILED), swept (abandoned dirs)",
    ["action"],
)
UNPROTECTED_INTERVALS = Gauge(
    "trainyard_checkpoint_unprotected_intervals",
    "Whole checkpoint intervals a running job has trained past its newest READY checkpoint", ["job_id"],
)
STALLS = Counter(
    "trainyard_checkpoint_stalls_total",
    "Times a running job became CheckpointsStalled (no READY checkpoint for stall_intervals intervals)",
)
