"""The one exception tree of trainyard.

    TrainyardError                      (retryable: bool, on the class or the instance)
    ├── ConfigError                     settings that cannot work; fix the environment
    ├── SpecError                       a training spec that is invalid (field, message)
    │   └── UnknownReferenceError       a model or dataset reference that does not resolve
    ├── NotFoundError                   a job, checkpoint or artifact that does not exist
    ├── AuthError                       missing or wrong credentials
    ├── ConflictError                   a state transition that is not allowed now
    ├── FencingError                    a write carrying a stale epoch (a zombie's write)
    │   └── StaleLeaderError            a scheduler's write under a leader epoch another instance replaced
    ├── LeaseConflictError              a device already held by another live allocation
    ├── InfrastructureError             broker / Redis / filesystem trouble   (retryable)
    │   ├── BusError
    │   ├── StateStoreError
    │   │   ├── EpochNotReplicatedError  an epoch increment no replica acknowledged in time: not used
    │   │   └── WriteNotReplicatedError  a write to acknowledge that no replica confirmed (or a failover lost)
    │   └── TrackingError               (telemetry) an MLflow server refused or did not answer
    ├── CheckpointError                 a checkpoint that cannot be written or restored
    │   └── CheckpointCorruptError      size or sha256 mismatch, missing shard or manifest
    ├── DataError                       a dataset shard that is missing or fails its sha256
    └── NonFiniteError                  a NaN or Inf loss or gradient: the attempt stops, nothing is saved

Library errors (aiokafka, redis, torch) are translated where they enter, `raise … from exc`.
"""

from __future__ import annotations


class TrainyardError(Exception):
    """Root of every error trainyard raises on purpose."""

    retryable: bool = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        if retryable is not None:
            self.retryable = retryable


class ConfigError(TrainyardError):
    """Settings that cannot work; the message says which variable to fix."""


class SpecError(TrainyardError):
    """An invalid training spec. ``field`` is the dotted camelCase path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class UnknownReferenceError(SpecError):
    """A catalog reference (model, dataset) that does not resolve."""


class NotFoundError(TrainyardError):
    """A job, checkpoint or artifact that does not exist (or is not visible to this tenant)."""


class AuthError(TrainyardError):
    """Missing or wrong credentials."""


class ConflictError(TrainyardError):
    """A state transition that is not allowed from the current state."""


class FencingError(TrainyardError):
    """A write carrying an epoch older than the current one; the writer is a zombie."""


class StaleLeaderError(FencingError):
    """The writer led the scheduler under a leader epoch that is no longer current: it lost leadership."""


class LeaseConflictError(TrainyardError):
    """A device is already held by another live allocation."""

    retryable = True


class InfrastructureError(TrainyardError):
    """Broker, Redis or filesystem trouble; retrying later may succeed."""

    retryable = True


class BusError(InfrastructureError):
    """The Kafka-protocol broker refused or could not be reached."""


class StateStoreError(InfrastructureError):
    """Redis refused or could not be reached."""


class WriteNotReplicatedError(StateStoreError):
    """A write the platform was about to acknowledge (a 202, a READY, a control request, a revocation) that no
    replica confirmed in time, or that a failover lost (Redis behind Sentinel, docs/design.md §5.2.1). It is
    not acknowledged; retrying (idempotently: the same Idempotency-Key, the same event) may succeed."""


class EpochNotReplicatedError(StateStoreError):
    """A fencing or leader epoch increment that the replicas did not acknowledge in time (Redis behind
    Sentinel, docs/design.md §5.2.1). A failover could lose it and hand the same number out again, so it
    is not used; retrying once a replica is in sync may succeed."""


class CheckpointError(TrainyardError):
    """A checkpoint that cannot be written or restored."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose manifest or shards do not match what was recorded."""


class DataError(TrainyardError):
    """A dataset shard that is missing or fails its sha256."""


class NonFiniteError(TrainyardError):
    """A NaN or Inf loss or gradient norm; the attempt stops with reason "nan"."""
