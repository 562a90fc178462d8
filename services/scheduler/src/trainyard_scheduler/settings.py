"""Scheduler settings (``TRAINYARD_*``), parsed once in ``main()``."""

from __future__ import annotations

from pydantic import Field, model_validator

from trainyard_common.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    """What the scheduler needs beyond the common settings."""

    node_timeout_s: float = Field(
        default=15.0, gt=0, description="a node is available while its last heartbeat is younger than this"
    )
    tick_s: float = Field(default=1.0, gt=0, description="seconds between scheduling passes")
    rendezvous_port_min: int = Field(default=29400, gt=1024, lt=65536,
                                     description="lowest torch.distributed rendezvous port handed out")
    rendezvous_port_max: int = Field(default=29999, gt=1024, lt=65536,
                                     description="highest rendezvous port handed out")
    max_attempts: int = Field(default=3, gt=0,
                              description="failed attempts allowed for jobs the scheduler creates itself")
    retry_backoff_s: float = Field(default=2.0, ge=0, description="back-off after the first failed attempt")
    retry_backoff_max_s: float = Field(default=60.0, ge=0, description="back-off cap (doubles per failure)")
    start_timeout_s: float = Field(default=120.0, gt=0,
                                   description="an attempt whose ranks have not all started by then fails")
    final_checkpoint_timeout_s: float = Field(
        default=300.0, gt=0,
        description="after every rank exited 0, how long to wait for the READY checkpoint at maxSteps",
    )
    leader_ttl_s: float = Field(default=5.0, gt=0,
                                description="lease of the scheduling leader lock (one active scheduler)")

    @model_validator(mode="after")
    def _port_range(self) -> SchedulerSettings:
        if self.rendezvous_port_min > self.rendezvous_port_max:
            raise ValueError("rendezvous_port_min must not exceed rendezvous_port_max")
        return self
