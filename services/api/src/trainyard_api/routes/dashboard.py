"""The ``jobs`` routes behind the dashboard: metric history, rank logs, live updates (server-sent
events), the cluster's capacity and queue. The logic is in :mod:`~trainyard_telemetry.metrics_history`,
:mod:`~trainyard_api.logs`, :mod:`~trainyard_api.live` and :mod:`~trainyard_api.cluster`;
:func:`job_summaries` also feeds the process's live hub (``server.py``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from trainyard_contract.records import JobRecord, Progress
from trainyard_contract.storage import ArtifactLayout
from trainyard_runtime.store import Keys
from trainyard_telemetry.metrics_history import CURVES, MetricHistory, parse_series

from trainyard_api.auth import recheck
from trainyard_api.cluster import ClusterService, ClusterView
from trainyard_api.deps import Ctx, JobId, Tenant
from trainyard_api.http_errors import AUTH_ERRORS, JOB_ERRORS, invalid
from trainyard_api.live import LiveHub, sse
from trainyard_api.logs import RankLogs, pick_attempt
from trainyard_api.schemas import _Out
from trainyard_api.views import job_summary

MAX_POINTS = 20_000


class MetricSeries(_Out):
    steps: list[int]
    values: list[float | None] = Field(description="null only in a per-rank bucket the rank has no step in")
    total_points: int = Field(description="stored points of the series in the window, before down-sampling")
    minimum: list[float | None] | None = Field(default=None, alias="min", description="per-rank buckets: min",
                                               exclude_if=lambda v: v is None)
    maximum: list[float | None] | None = Field(default=None, alias="max", description="per-rank buckets: max",
                                               exclude_if=lambda v: v is None)


class MetricHistoryView(_Out):
    job_id: str
    # always in the answer, null or not (a generated client reads them as required keys)
    from_step: int | None = Field(description="the window's first step: fromStep (default 0) within the stored "
                                              "steps; when none is stored there, fromStep as asked (null if not)")
    to_step: int | None = Field(description="the window's last step: toStep (default: the last stored) within "
                                            "the stored steps; when none is stored there, toStep as asked "
                                            "(null if not)")
    method: Literal["lttb", "minmax", "all"]
    series: dict[str, MetricSeries]
    ranks: dict[str, dict[str, MetricSeries]] | None = Field(
        default=None, description="with byRank=true: per rank, the timing series in the same step buckets "
                                  "(bucket means, with min and max)", exclude_if=lambda v: v is None)


class AttemptRanks(_Out):
    attempt: int
    state: str
    world_size: int
    ranks: list[int]
    ended_at: str | None


class JobRanks(_Out):
    job_id: str
    attempts: list[AttemptRanks]
    reported_ranks: list[int] = Field(description="ranks that have metric history")


async def job_summaries(redis, ids):
    """job id → (tenant, JobSummary JSON), for the live hub."""
    raws = await redis.mget([Keys.job(j) for j in ids] + [Keys.progress(j) for j in ids])
    out = {}
    for i, job_id in enumerate(ids):
        if not raws[i]:
            continue
        job = JobRecord.model_validate_json(raws[i])
        progress = Progress.model_validate_json(raws[len(ids) + i]) if raws[len(ids) + i] else None
        out[job_id] = (job.tenant, job_summary(job, progress).model_dump_json(by_alias=True))
    return out


def live_hub(request: Request) -> LiveHub:
    """The process's hub (``server.py`` makes it and feeds it from the bus); one made here otherwise."""
    hub = getattr(request.app.state, "live", None)
    if hub is None:
        redis = request.app.state.context.store.redis
        hub = request.app.state.live = LiveHub(lambda ids: job_summaries(redis, ids))
    hub.start()
    return hub


def metric_history(request: Request) -> MetricHistory:
    """The process's history reader (one binary Redis client per process)."""
    history = getattr(request.app.state, "history", None)
    if history is None:
        history = request.app.state.history = MetricHistory(request.app.state.context.store.redis)
    return history


router = APIRouter()


@router.get("/v1/training-jobs/{job_id}/metrics", response_model=MetricHistoryView, response_model_by_alias=True,
            tags=["jobs"], summary="A job's metric history, down-sampled",
            responses=JOB_ERRORS)
async def job_metrics(
    ctx: Ctx, tenant: Tenant, job_id: JobId, request: Request,
    series: Annotated[str, Query(max_length=2000, description="comma-separated: loss, lr, tokensPerSecond, "
                                 "mfu, stepSeconds, computeSeconds, collectiveSeconds, dataWaitSeconds, "
                                 "checkpointSeconds, or a name the script reported in its metrics")]
    = ",".join(CURVES),
    from_step: Annotated[int | None, Query(alias="fromStep", ge=0, le=2**31 - 1)] = None,
    to_step: Annotated[int | None, Query(alias="toStep", ge=0, le=2**31 - 1)] = None,
    max_points: Annotated[int, Query(alias="maxPoints", ge=2, le=MAX_POINTS,
                                     description="at most this many points per series")] = 2000,
    method: Annotated[Literal["lttb", "minmax"], Query(description="how to down-sample curves")] = "lttb",
    by_rank: Annotated[bool, Query(alias="byRank", description="also each rank's timing series")] = False,
) -> MetricHistoryView:
    """Every step of every rank is stored at ingest (the newest attempt's value of a step wins);
    the answer is down-sampled to `maxPoints` per series by a shape-preserving method (LTTB on a
    min/max preselection, or min/max per bucket), in the window `fromStep`..`toStep` (zoom). `method`
    is `all` when nothing had to be dropped. With `byRank=true`, `ranks` gives each rank's timing
    series in step buckets shared by every rank (a heat map): `steps` are the buckets' first steps."""
    job = await ctx.jobs.get(tenant, job_id)
    history = metric_history(request)
    names = parse_series(series, await history.custom_series(job.job_id), by_rank=by_rank)
    answer = await history.query(job.job_id, names, from_step=from_step, to_step=to_step,
                                 max_points=max_points, method=method, by_rank=by_rank)
    return MetricHistoryView.model_validate(_plain(answer))


@router.get("/v1/training-jobs/{job_id}/ranks", response_model=JobRanks, tags=["jobs"],
            summary="The attempts and ranks of a job (for logs and heat maps)", responses=JOB_ERRORS)
async def job_ranks(ctx: Ctx, tenant: Tenant, job_id: JobId, request: Request) -> JobRanks:
    """Each attempt with its state and ranks (0..worldSize-1), and the ranks with metric history."""
    job = await ctx.jobs.get(tenant, job_id)
    return JobRanks(job_id=job.job_id, reported_ranks=await metric_history(request).ranks(job.job_id),
                    attempts=[AttemptRanks(attempt=a.attempt, state=a.state, world_size=a.world_size,
                                           ranks=list(range(a.world_size)),
                                           ended_at=a.ended_at.isoformat() if a.ended_at else None)
                              for a in job.attempts])


@router.get("/v1/training-jobs/{job_id}/logs", tags=["jobs"], summary="A rank's log (tail, or follow)",
            response_class=StreamingResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "the log's lines (streamed with follow=true)"},
                       **AUTH_ERRORS, **invalid(),
                       404: {"description": "no such job for this tenant, or no such attempt or rank (named)",
                             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/"
                                                                                 "ErrorMessage"}}}}})
async def job_logs(
    ctx: Ctx, tenant: Tenant, job_id: JobId,
    attempt: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="default: the newest")] = None,
    rank: Annotated[int, Query(ge=0, le=65_535)] = 0,
    tail: Annotated[int, Query(ge=0, le=100_000, description="lines from the end")] = 200,
    follow: Annotated[bool, Query(description="stream new lines until the attempt ends")] = False,
) -> StreamingResponse:
    """The last `tail` lines of the rank's log; with `follow=true` the response stays open and
    streams new lines while the attempt runs, and closes once it has ended."""
    job = await ctx.jobs.get(tenant, job_id)
    chosen = pick_attempt(job, attempt, rank)
    logs = RankLogs(ArtifactLayout(ctx.settings.artifact_root_abs))
    if not follow:
        return StreamingResponse(iter([await logs.tail(job, chosen, rank, tail)]), media_type="text/plain")

    async def ended() -> bool:
        current = await ctx.store.get_job(job.job_id)
        a = next((x for x in current.attempts if x.attempt == chosen.attempt), None) if current else None
        return a is None or a.ended_at is not None

    return StreamingResponse(logs.follow(job, chosen, rank, tail, ended), media_type="text/plain",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(name: str, title: str, data: dict[str, object]) -> dict[str, object]:
    """One kind of server-sent event as an object (OpenAPI 3.2's reading of `text/event-stream`): its
    `event:` field, and its `data:` line, a JSON text of ``data``'s schema."""
    return {"type": "object", "title": title, "required": ["event", "data"], "additionalProperties": False,
            "properties": {"event": {"const": name},
                           "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data}}}


SERVER_EVENT_SCHEMA = {
    "description": "each event of the stream, as its fields: `event` and `data` (one line of JSON)",
    "oneOf": [_event("job", "JobEvent", {"$ref": "#/components/schemas/JobSummary"}),
              _event("resync", "ResyncEvent", {"type": "object", "required": ["dropped"],
                                               "properties": {"dropped": {"type": "integer", "minimum": 0,
                                                                          "description": "changes not sent"}}}),
              _event("closed", "ClosedEvent", {
                  "type": "object", "required": ["reason", "kind"],
                  "properties": {"reason": {"type": "string", "description": "why, as a 401 would say it"},
                                 "kind": {"enum": ["revoked", "expired", "unknown"],
                                          "description": "what became of the token"}}})],
}
"""What ``GET /v1/events`` sends, event by event (a 3.1 document has no item schema: this is the schema)."""


@router.get("/v1/events", tags=["jobs"], summary="Live updates of the tenant's jobs (server-sent events)",
            response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {"schema": SERVER_EVENT_SCHEMA}},
                             "description": "`event: job` + `data: <JobSummary JSON>` on each change of state, "
                                            "progress (at most 2/s per job), attempts or checkpoints; "
                                            "`event: resync` + `data: {\"dropped\": n}` when the client fell "
                                            "behind (re-read); `: keepalive` (a comment) every 15 s; "
                                            "`event: closed` + `data: {\"reason\", \"kind\"}` as the last "
                                            "event once the token is revoked or expired (it is read again "
                                            "before every event and every second). The schema is that of "
                                            "one event"},
                       **JOB_ERRORS})
async def events(
    ctx: Ctx, tenant: Tenant, request: Request,
    job_id: Annotated[str | None, Query(alias="jobId", max_length=128, description="only this job")] = None,
) -> StreamingResponse:
    """Read with `fetch()` and a stream reader (it needs the Authorization header, which
    EventSource cannot send). With `jobId`, the first event is the job's current summary. The token is
    read again before each event and at least every second: once revoked or expired, the stream sends
    `closed` with the reason and ends (nothing after the revocation reaches it)."""
    initial = []
    hub = live_hub(request)
    if job_id is not None:
        job = await ctx.jobs.get(tenant, job_id)
        found = await job_summaries(ctx.store.redis, [job.job_id])
        initial = [sse("job", found[job.job_id][1])] if job.job_id in found else []
    authorization = request.headers.get("authorization")

    async def check() -> dict[str, str] | None:
        return await recheck(ctx.store, authorization)

    return StreamingResponse(hub.stream(tenant.tenant, job_id, initial, check), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/v1/cluster", response_model=ClusterView, tags=["jobs"],
            summary="Capacity by device type and the queue", responses=AUTH_ERRORS)
async def cluster(ctx: Ctx, tenant: Tenant) -> ClusterView:
    """Devices per type (free, held by a job, on quarantined or draining nodes) and every queued job in
    placement order with why it waits; another tenant's job shows without its id and tenant."""
    return await ClusterService(ctx.store).view(tenant.tenant)


def _plain(value: Any) -> Any:
    """Dataclasses of the history → plain dicts with the answer's camelCase names."""
    from dataclasses import is_dataclass

    if is_dataclass(value):
        series: Any = value  # a history series (is_dataclass narrows to no particular class)
        d = {"steps": series.steps, "values": series.values, "totalPoints": series.total_points}
        if series.minimum is not None:
            d["min"], d["max"] = series.minimum, series.maximum
        return d
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
