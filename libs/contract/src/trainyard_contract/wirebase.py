"""What the events and the REST bodies are both made of: the state names, the frozen camelCase base, and the
two small models a REST body embeds (``CheckpointRef``, ``PlacementDetail``).

A module of its own so that a reader of REST bodies (``trainyard_contract.wire``, so the CLI) does not build
every event model to parse a job list: importing :mod:`trainyard_contract.events` builds some 80 pydantic
classes (a job spec, the records behind it), about 0.15 s of every ``trainyard jobs list``.
:mod:`~trainyard_contract.events` and :mod:`~trainyard_contract.records` re-export these names; the contract is
unchanged (same classes, same schemas).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

JobState = Literal["queued", "running", "paused", "succeeded", "failed", "cancelled"]
CheckpointState = Literal["PENDING", "READY", "FAILED", "DELETED"]
"""PENDING → READY | FAILED; READY → DELETED when retention removes it (its manifest first)."""


class FrozenWire(BaseModel):
    """camelCase on the wire, immutable, unknown fields ignored (the events' base)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="ignore",
        protected_namespaces=(),
    )


class PlacementDetail(FrozenWire):
    """How local a gang's placement is (the scheduler's placement score explained).

    Links are the gang's communication pairs: TP ring neighbours, DP ring neighbours within a
    pipeline stage, and adjacent pipeline stages; each is counted by the widest boundary it crosses.
    """

    mode: str = Field(default="pack", description="pack | rack | domain | spread[:N]")
    nodes: int = 0
    nvlink_domains: int = 0
    racks: int = 0
    network_tiers: int = 0
    links: int = 0
    cross_node_links: int = Field(default=0, description="links leaving an NVLink domain (over the NIC)")
    cross_rack_links: int = 0
    cross_tier_links: int = 0
    tp_groups_split: int = Field(default=0, description="TP groups not inside one NVLink domain (0 by construction)")


class CheckpointRef(FrozenWire):
    manifest_uri: str
    global_step: int
    attempt: int
    content_hash: str | None = None
