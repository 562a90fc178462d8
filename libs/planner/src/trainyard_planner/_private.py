"""Helpers shared by the planner's modules; not part of the public surface."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

GB = 1e9
"""Decimal gigabyte: device memory, bandwidth and storage are quoted in powers of ten here."""


class Model(BaseModel):
    """Base of every planner value: immutable, camelCase on the wire, snake_case in Python."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="forbid",
        protected_namespaces=(),
    )

    def wire(self) -> dict:
        """JSON-ready camelCase data (what the CLI's ``--json`` and ``POST /v1/plan`` return)."""
        return self.model_dump(mode="json", by_alias=True)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def gb(n_bytes: float) -> str:
    """Bytes as decimal GB for a human: ``80`` for 80e9, ``93.1`` for 93.08e9."""
    value = n_bytes / GB
    rounded = round(value, 1)
    return f"{rounded:.0f}" if rounded == int(rounded) else f"{rounded:.1f}"
