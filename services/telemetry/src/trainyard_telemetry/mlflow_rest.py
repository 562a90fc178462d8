"""MLflow's tracking REST API (``/api/2.0/mlflow/…``) over httpx: the few calls the exporter makes.

Not the ``mlflow`` package: its client pulls in pandas, SQLAlchemy and more, and pins that would fight the
services'; the REST API is the server's stable contract (https://mlflow.org/docs/latest/rest-api.html).
Errors come out as :class:`TrackingError`, retryable or not: a refused connection, a timeout, a 429 or a 5xx may
pass; a 4xx will not (a bad request stays bad). Redirects are not followed (a server cannot send the platform on
to another address).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from trainyard_contract.errors import InfrastructureError

__all__ = ["MlflowRest", "TrackingError"]


class TrackingError(InfrastructureError):
    """A tracking target (an MLflow server) refused or did not answer; ``retryable`` says whether trying again
    may help (the exporter backs off either way: a refused request may pass once the server is fixed)."""


def _number(value: float) -> float | str:
    # protobuf's JSON form: NaN and the infinities are strings (bare NaN is not JSON)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


class MlflowRest:
    """One MLflow server's tracking API; ``client`` is shared by every server the exporter talks to."""

    def __init__(self, client: httpx.AsyncClient, uri: str) -> None:
        self.client = client
        self.base = uri.rstrip("/") + "/api/2.0/mlflow/"

    async def _call(self, method: str, path: str, *, body: Mapping[str, Any] | None = None,
                    params: Mapping[str, str] | None = None, missing_ok: bool = False) -> dict[str, Any] | None:
        try:
            answer = await self.client.request(method, self.base + path, json=body, params=params,
                                               follow_redirects=False)
        except httpx.HTTPError as exc:
            raise TrackingError(f"MLflow {path}: {type(exc).__name__}: {exc}", retryable=True) from exc
        if answer.status_code == 404 and missing_ok:
            return None
        if answer.status_code >= 300:
            text = answer.text[:500]
            retryable = answer.status_code in (408, 429) or answer.status_code >= 500
            raise TrackingError(f"MLflow {path}: HTTP {answer.status_code}: {text}", retryable=retryable)
        try:
            data = answer.json()
        except ValueError as exc:
            raise TrackingError(f"MLflow {path}: not JSON (is this an MLflow server?)", retryable=False) from exc
        return data if isinstance(data, dict) else {}

    async def experiment_id(self, name: str) -> str:
        """The experiment's id, creating the experiment when it does not exist."""
        found = await self._call("GET", "experiments/get-by-name", params={"experiment_name": name},
                                 missing_ok=True)
        if found is not None:
            return str(found["experiment"]["experiment_id"])
        try:
            created = await self._call("POST", "experiments/create", body={"name": name})
        except TrackingError:
            # created meanwhile by another exporter: read it again
            again = await self._call("GET", "experiments/get-by-name", params={"experiment_name": name})
            assert again is not None
            return str(again["experiment"]["experiment_id"])
        assert created is not None
        return str(created["experiment_id"])

    async def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        """The id of a live run of the experiment whose tag ``tag`` is ``value`` (the oldest), if any."""
        found = await self._call("POST", "runs/search", body={
            "experiment_ids": [experiment_id], "filter": f"tags.`{tag}` = '{value}'", "max_results": 1,
            "order_by": ["attributes.start_time ASC"]})
        runs = (found or {}).get("runs") or []
        return str(runs[0]["info"]["run_id"]) if runs else None

    async def create_run(self, experiment_id: str, name: str, start_ms: int, tags: Mapping[str, str]) -> str:
        created = await self._call("POST", "runs/create", body={
            "experiment_id": experiment_id, "run_name": name, "start_time": start_ms,
            "tags": [{"key": k, "value": v} for k, v in tags.items()]})
        assert created is not None
        return str(created["run"]["info"]["run_id"])

    async def log_batch(self, run_id: str, *, metrics: Sequence[tuple[str, float, int, int]] = (),
                        params: Mapping[str, str] | None = None, tags: Mapping[str, str] | None = None) -> None:
        """One runs/log-batch: ``metrics`` as (key, value, timestamp ms, step), at most 1000; params and tags at
        most 100 together."""
        await self._call("POST", "runs/log-batch", body={
            "run_id": run_id,
            "metrics": [{"key": k, "value": _number(v), "timestamp": t, "step": s} for k, v, t, s in metrics],
            "params": [{"key": k, "value": v} for k, v in (params or {}).items()],
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]})

    async def end_run(self, run_id: str, status: str, end_ms: int) -> None:
        await self._call("POST", "runs/update", body={"run_id": run_id, "status": status, "end_time": end_ms})
