"""Waiting for what a test expects to happen, without asserting how long it took: poll until a check is truthy
or a generous deadline passes (then fail with what was last seen)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


def wait_for(check: Callable[[], T], what: str, timeout_s: float, every_s: float = 0.5) -> T:
    """``check()`` until it returns something truthy (returned); AssertionError naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}; last: {str(last)[:3000]}")


def wait_for_state(client: httpx.Client, job_id: str, states: set[str], timeout_s: float,
                   every_s: float = 1.0) -> dict[str, Any]:
    """The job's view once its state is one of ``states``."""
    seen: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        seen.update(client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json())
        return dict(seen) if seen["state"] in states else None

    try:
        return wait_for(reached, f"job {job_id} in {sorted(states)}", timeout_s, every_s)
    except AssertionError:
        raise AssertionError(f"job {job_id} still {seen.get('state')} after {timeout_s}s: "
                             f"{json.dumps(seen)[:2000]}") from None
