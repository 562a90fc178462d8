"""Per-job Prometheus series: set from rank 0's steps and the refresh walk, removed once a job finished more
than ``linger_s`` ago or is gone, so their number stays bounded by the live (and recent) jobs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import REGISTRY

from trainyard_contract.events import StepMetrics
from trainyard_contract.records import JobRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_telemetry.goodput import Ledger
from trainyard_telemetry.jobmetrics import JobSeries, Seen, expired
from trainyard_api.schemas import EXAMPLE_SPEC

T0 = datetime(2025, 1, 1, tzinfo=UTC)
SPEC = TrainingSpec.model_validate(EXAMPLE_SPEC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def job(job_id: str, state: str = "running", updated_s: float = 0.0) -> JobRecord:
    return JobRecord(job_id=job_id, tenant="t", spec=SPEC, spec_hash=SPEC.spec_hash(), state=state,
                     created_at=T0, updated_at=at(updated_s))


def step(job_id: str, rank: int = 0, seconds: float = 0.25) -> StepMetrics:
    return StepMetrics(job_id=job_id, tenant="t", attempt=1, rank=rank, step=3, loss=1.0, consumed_tokens=10,
                       step_seconds=seconds, tokens_per_second=400.0)


def value(name: str, job_id: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"tenant": "t", "job_id": job_id})


def half(allocated: int = 100) -> Ledger:
    ledger = Ledger(allocated)
    ledger.parts["productive"] = allocated // 2
    return ledger


def test_expired_are_the_gone_and_the_long_finished() -> None:
    seen = {"live": Seen("t", None), "recent": Seen("t", at(100)), "old": Seen("t", at(0))}
    labelled = {"live": "t", "recent": "t", "old": "t", "deleted": "t"}
    assert expired(labelled, seen, now=at(150), linger_s=120) == {"old", "deleted"}


def test_rank_0_sets_step_time_and_throughput() -> None:
    series = JobSeries(linger_s=60)
    series.on_step(step("jm-a", rank=1, seconds=9.0))
    assert value("trainyard_job_step_seconds", "jm-a") is None
    before = REGISTRY.get_sample_value("trainyard_step_seconds_count", {"tenant": "t"}) or 0
    series.on_step(step("jm-a"))
    assert value("trainyard_job_step_seconds", "jm-a") == 0.25
    assert value("trainyard_job_tokens_per_second", "jm-a") == 400.0
    assert REGISTRY.get_sample_value("trainyard_step_seconds_count", {"tenant": "t"}) == before + 1


def test_a_finished_jobs_series_linger_then_go() -> None:
    series = JobSeries(linger_s=60)
    series.on_step(step("jm-b"))
    for now_s, expect in ((10, 0.5), (50, 0.5), (200, None)):
        series.begin()
        series.observe(job("jm-b", "succeeded", updated_s=20), half(), at(now_s))
        series.prune(at(now_s))
        assert value("trainyard_job_goodput_ratio", "jm-b") == expect, now_s
    assert value("trainyard_job_step_seconds", "jm-b") is None
    series.begin()  # the next walks do not bring it back
    series.observe(job("jm-b", "succeeded", updated_s=20), half(), at(260))
    series.prune(at(260))
    assert value("trainyard_job_goodput_ratio", "jm-b") is None


def test_a_job_first_seen_during_a_walk_waits_for_the_next_one() -> None:
    series = JobSeries(linger_s=60)
    series.begin()
    series.on_step(step("jm-c"))  # its first step lands while the walk runs; the walk missed the job
    assert series.prune(at(0)) == set()
    assert value("trainyard_job_step_seconds", "jm-c") == 0.25
    series.begin()
    assert series.prune(at(1)) == {"jm-c"}  # a whole walk without it: deleted
    assert value("trainyard_job_step_seconds", "jm-c") is None


def test_nothing_allocated_yet_sets_no_goodput() -> None:
    series = JobSeries()
    series.begin()
    series.observe(job("jm-d", "queued"), Ledger(), at(0))
    series.prune(at(0))
    assert value("trainyard_job_goodput_ratio", "jm-d") is None
