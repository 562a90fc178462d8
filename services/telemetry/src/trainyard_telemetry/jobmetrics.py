"""Per-job Prometheus series: rank 0's step time and throughput, the job's goodput.

``trainyard_job_step_seconds`` and ``trainyard_job_tokens_per_second`` follow rank 0's StepMetrics;
``trainyard_job_goodput_ratio`` (productive ÷ allocated device-time) is set by the goodput refresh loop
(``accounting.refresh``), which walks every job. Cardinality stays bounded: a job's series exist while it is
not finished and for ``linger_s`` after it finished (long enough for a scrape and for the dashboards' "last
value"), then they are removed (:func:`expired`). ``trainyard_step_seconds`` is the same step time as a
histogram by tenant, for quantiles across jobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import Gauge, Histogram

from trainyard_contract.events import TERMINAL_STATES, StepMetrics
from trainyard_contract.records import JobRecord
from trainyard_telemetry.goodput import Ledger

_JOB = ["tenant", "job_id"]
JOB_STEP_SECONDS = Gauge("trainyard_job_step_seconds", "rank 0's latest step time of a job", _JOB)
JOB_TOKENS_PER_SECOND = Gauge("trainyard_job_tokens_per_second", "rank 0's latest throughput of a job", _JOB)
JOB_GOODPUT = Gauge("trainyard_job_goodput_ratio", "a job's productive ÷ allocated device-time (0..1)", _JOB)
STEP_SECONDS = Histogram(
    "trainyard_step_seconds", "rank 0's step time, every job's, by tenant", ["tenant"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
_GAUGES = (JOB_STEP_SECONDS, JOB_TOKENS_PER_SECOND, JOB_GOODPUT)


@dataclass(frozen=True)
class Seen:
    """What the refresh walk last saw of a job: its tenant, and when it finished (None: not finished)."""

    tenant: str
    finished_at: datetime | None


def finished_at(job: JobRecord) -> datetime | None:
    """When a finished job finished (its record's last update); None while it is not finished."""
    return job.updated_at if job.state in TERMINAL_STATES else None


def expired(labelled: Mapping[str, str], seen: Mapping[str, Seen], *, now: datetime, linger_s: float) -> set[str]:
    """Of the jobs with series (job id → tenant label), those to remove: gone from the walk, or finished more
    than ``linger_s`` ago."""
    out = set()
    for job_id in labelled:
        s = seen.get(job_id)
        if s is None or (s.finished_at is not None and (now - s.finished_at).total_seconds() > linger_s):
            out.add(job_id)
    return out


class JobSeries:
    """Sets and removes the per-job series (one instance per API process; only the primary serves them).

    A refresh walk is ``begin()``, ``observe()`` for each job, ``prune(now)``; a job first labelled during a
    walk (its first step) is left for the next walk to judge."""

    def __init__(self, *, linger_s: float = 900.0) -> None:
        self.linger_s = linger_s
        self._labelled: dict[str, str] = {}  # job id → the tenant label its series carry
        self._walk: dict[str, Seen] = {}
        self._before: set[str] = set()

    def on_step(self, m: StepMetrics) -> None:
        """Rank 0's step: the job's step time and throughput."""
        if m.rank != 0:
            return
        tenant = self._label(m.job_id, m.tenant or "")
        JOB_STEP_SECONDS.labels(tenant, m.job_id).set(m.step_seconds)
        if m.tokens_per_second is not None:
            JOB_TOKENS_PER_SECOND.labels(tenant, m.job_id).set(m.tokens_per_second)
        STEP_SECONDS.labels(tenant).observe(m.step_seconds)

    def begin(self) -> None:
        self._walk = {}
        self._before = set(self._labelled)

    def observe(self, job: JobRecord, ledger: Ledger, now: datetime) -> None:
        """One job of the refresh walk: its goodput, once anything was allocated and unless it finished
        more than ``linger_s`` ago."""
        done = finished_at(job)
        self._walk[job.job_id] = Seen(job.tenant, done)
        lingering = done is None or (now - done).total_seconds() <= self.linger_s
        if ledger.goodput is not None and lingering:
            JOB_GOODPUT.labels(self._label(job.job_id, job.tenant), job.job_id).set(ledger.goodput)

    def prune(self, now: datetime) -> set[str]:
        """After a walk: remove the series of jobs it did not see or that finished long enough ago."""
        judged = {j: t for j, t in self._labelled.items() if j in self._before or j in self._walk}
        gone = expired(judged, self._walk, now=now, linger_s=self.linger_s)
        for job_id in gone:
            tenant = self._labelled.pop(job_id)
            for gauge in _GAUGES:
                try:
                    gauge.remove(tenant, job_id)
                except KeyError:
                    pass  # that gauge never had this job
        return gone

    def _label(self, job_id: str, tenant: str) -> str:
        return self._labelled.setdefault(job_id, tenant)
