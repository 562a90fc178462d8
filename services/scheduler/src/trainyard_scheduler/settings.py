"""Scheduler settings (``TRAINYARD_*``), parsed once in ``main()``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from trainyard_contract.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    """What the scheduler needs beyond the common settings."""

    node_timeout_s: float = Field(
        default=15.0, gt=0,
        description="a node is available while its last heartbeat is younger than this; after it, the node's "
                    "allocations are revoked and their jobs requeued",
    )
    tick_s: float = Field(default=1.0, gt=0, description="seconds between scheduling passes when nothing changes "
                          "(a change — a submission, a job or node state — starts a pass at once)")
    pass_rest_ratio: float = Field(
        default=1.0, ge=0,
        description="after a pass that took over 10 ms (a deep queue), the next one waits this many times as long, "
                    "so that passes woken by a burst of submissions leave CPU to the rest (1: at most half a core)")
    node_refresh_s: float = Field(
        default=1.0, gt=0,
        description="the leader re-reads the node records at least this often for their heartbeats' times (a node "
                    "change — drain, quarantine, devices — is read at once)")
    rendezvous_port_min: int = Field(default=29400, gt=1024, lt=65536,
                                     description="lowest torch.distributed rendezvous port handed out")
    rendezvous_port_max: int = Field(default=29999, gt=1024, lt=65536,
                                     description="highest rendezvous port handed out")
    retry_backoff_s: float = Field(
        default=0.5, ge=0,
        description="back-off after the first failed attempt since progress (a rank lost after the job made "
                    "progress is retried about this soon; a job that fails again without progress waits twice "
                    "as long each time)")
    retry_backoff_max_s: float = Field(default=60.0, ge=0, description="back-off cap (doubles per failure)")
    checkpoint_settle_s: float = Field(
        default=15.0, ge=0,
        description="after an attempt ends, its next attempt waits up to this long for a checkpoint whose every "
                    "shard is recorded but which is not READY yet (placing the next attempt would fence it out); "
                    "0 = never wait",
    )
    start_timeout_s: float = Field(default=120.0, gt=0,
                                   description="an attempt whose ranks have not all started by then fails")
    final_checkpoint_timeout_s: float = Field(
        default=300.0, gt=0,
        description="after every rank exited 0, how long to wait for the READY checkpoint at maxSteps",
    )
    leader_ttl_s: float = Field(
        default=3.0, gt=0,
        description="TTL of the fenced leader lease; a standby scheduler takes over within about this long "
                    "after the leader stops renewing it (each takeover increments the leader epoch)",
    )
    lease_ttl_s: float = Field(
        default=60.0, ge=0,
        description="TTL of device leases, renewed by every NodeHeartbeat of the node (0 = no expiry); "
                    "must exceed node_timeout_s",
    )
    pause_grace_s: float = Field(
        default=300.0, gt=0,
        description="a pause (or drain) asks the ranks for a checkpoint first; after this long without their own "
                    "checkpoint READY and every rank exited, the attempt is revoked anyway (its ranks are stopped) "
                    "and resumes later from the last READY checkpoint",
    )
    max_total_failures: int | None = Field(
        default=None, gt=0,
        description="optional cap on all failed attempts of a job; max_attempts counts only failures in a row "
                    "without a new READY checkpoint",
    )
    republish_after_s: float = Field(
        default=15.0, gt=0,
        description="an attempt whose ranks have not all started after this long gets its GangAllocated "
                    "published again (same allocation and epoch; the broker may have lost it)",
    )
    republish_max: int = Field(default=3, ge=0, description="times a GangAllocated is published again at most")
    straggler_detection: bool = Field(default=True, description="consume StepMetrics to find straggler ranks")
    straggler_window_steps: int = Field(default=20, ge=1, description="steps per straggler window")
    straggler_factor: float = Field(
        default=1.3, gt=1.0, description="a rank whose median compute time per step exceeds the median rank's by "
                                         "this factor is slow in that window",
    )
    straggler_windows: int = Field(default=3, ge=1,
                                   description="slow windows in a row before StragglerDetected is published")
    reputation_half_life_s: float = Field(
        default=6 * 3600.0, gt=0, description="a node's failure score halves every this many seconds",
    )
    quarantine_score: float = Field(
        default=3.0, gt=0,
        description="a node whose failure score reaches this is quarantined (each node-attributed failure adds "
                    "0.5-1, each straggler report 1)",
    )
    reinstate_score: float = Field(
        default=1.0, gt=0, description="a node quarantined by its score returns when the score decays below this",
    )
    reputation_per_tenant_cap: float | None = Field(
        default=1.5, gt=0,
        description="the most one tenant's failures (what its ranks report: exits, signals, hangs, log markers, "
                    "step times) add to a node's decaying score, so that no tenant can quarantine a node alone by "
                    "failing on purpose; a node going silent ('lost') is not capped. Unset (empty) on a "
                    "single-tenant cluster, where one tenant's failures alone should quarantine a node",
    )

    @field_validator("reputation_per_tenant_cap", mode="before")
    @classmethod
    def _no_cap(cls, value: object) -> object:
        return None if isinstance(value, str) and value.strip().lower() in ("", "none") else value
    quarantine_max_share: float = Field(
        default=0.5, gt=0, le=1,
        description="automatic quarantine never takes more than this share of a device type's devices out of "
                    "service, nor the last node of a type; beyond that the scheduler alerts (log + metric) and "
                    "only an admin quarantines",
    )
    silent_cluster_share: float = Field(
        default=0.5, gt=0, le=1,
        description="when more than this share of the recently seen nodes stop heart-beating together, the cause "
                    "is the control plane or the network: attempts are interrupted and retried without blaming a "
                    "node (1: never)",
    )
    queue_config: Path | None = Field(
        default=None,
        description="YAML/JSON file with tenants, quotas, priority classes, aging and preemption "
                    "(see services/scheduler/README.md); the Redis key ty:sched:queue-config wins when set",
    )
    max_wait_notes: int = Field(default=500, gt=0,
                                description="queued-reason updates written per scheduling pass at most")
    snapshot_verify_s: float = Field(
        default=60.0, gt=0,
        description="the leader's snapshot is checked against Redis (every job record read) about this often, at a "
                    "reconcile; the change log keeps it current meanwhile (design.md §3.9)")
    heartbeat_flush_s: float = Field(
        default=0.25, gt=0,
        description="routine heartbeats (nothing placement reads changed) are written together this often: every "
                    "node's latest in two round trips (node_health.flush_heartbeats)")
    wait_note_refresh_s: float = Field(
        default=30.0, ge=0,
        description="a queued job's reason is rewritten at most this often while the kind of wait is the same "
                    "(its wording carries live counts); a new kind of wait is written at the next pass")
    admit_pause_s: float = Field(
        default=0.0, ge=0,
        description="fault injection for tests only: pause between taking a gang's leases and recording it "
                    "(trainyard_scheduler.faults wraps the leases; the scheduler itself never reads it)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> SchedulerSettings:
        if self.rendezvous_port_min > self.rendezvous_port_max:
            raise ValueError("rendezvous_port_min must not exceed rendezvous_port_max")
        if self.lease_ttl_s and self.lease_ttl_s <= self.node_timeout_s:
            raise ValueError("lease_ttl_s must exceed node_timeout_s (or be 0)")
        if self.republish_after_s >= self.start_timeout_s:
            raise ValueError("republish_after_s must be shorter than start_timeout_s")
        if self.reinstate_score >= self.quarantine_score:
            raise ValueError("reinstate_score must be lower than quarantine_score")
        return self
