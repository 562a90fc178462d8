"""One chaos run: a reference job and faulted jobs of the same spec on the local stack, faults at
random moments, then every invariant checked over the recorded history (:class:`ChaosReport`)."""

from __future__ import annotations

import json
import re
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.chaos import invariants as inv
from tests.chaos.harness import SERVICES, ChaosRig, chaos_spec
from trainyard_contract.events import TERMINAL_STATES
from trainyard_contract.manifest import local_sha256, local_stat_size
from trainyard_contract.storage import uri_to_path

#: Fault kinds a plan is made of. "services" kills every service (and a node agent) in one wave.
KINDS = ("rank", "hang", "agent", "services", "redis", "broker", *(f"service:{s}" for s in SERVICES))


@dataclass
class ChaosReport:
    faults: dict[str, int] = field(default_factory=dict)  # kills of each kind
    checks: dict[str, int] = field(default_factory=dict)  # how many things each invariant looked at
    violations: dict[str, list[str]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)  # facts worth reading; never excuse a violation
    jobs: dict[str, str] = field(default_factory=dict)  # job id -> final state
    recovery_s: list[float] = field(default_factory=list)  # rank kill -> next attempt's first step
    lost_steps: list[tuple[int, int]] = field(default_factory=list)  # (lost steps, interval) per failure
    settle_s: list[float] = field(default_factory=list)  # heal -> what was written meanwhile READY/FAILED
    assembly_faults: list[str] = field(default_factory=list)  # kinds that hit a checkpoint being assembled
    timeline: list[dict[str, Any]] = field(default_factory=list)  # every fault: what, when, which job at which step
    evidence: str | None = None  # where a failing run's logs and state were kept
    seconds: float = 0.0

    @property
    def violation_count(self) -> int:
        return sum(len(v) for v in self.violations.values())

    def record(self, name: str, checked: int, problems: list[str]) -> None:
        self.checks[name] = self.checks.get(name, 0) + checked
        if problems:
            self.violations.setdefault(name, []).extend(problems)

    def summary(self) -> str:
        faults = ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items()))
        checks = ", ".join(f"{k} {n}" for k, n in sorted(self.checks.items()))
        lines = [f"chaos: {sum(self.faults.values())} faults ({faults}) in {self.seconds:.0f}s",
                 f"  jobs: {dict(Counter(self.jobs.values()))}",
                 f"  invariant checks: {checks}",
                 f"  violations: {self.violation_count}"]
        lines += [f"    {k}: {v}" for k, vs in self.violations.items() for v in vs]
        if self.recovery_s:
            lines.append(f"  rank kill -> next attempt's first step: {', '.join(f'{s:.1f}s' for s in self.recovery_s)}")
        if self.lost_steps:
            lines.append(f"  lost work per failure (steps/interval): {self.lost_steps}")
        if self.settle_s:
            lines.append(f"  heal -> checkpoints settled: max {max(self.settle_s):.1f}s "
                         f"over {len(self.settle_s)} heals")
        if self.assembly_faults:
            lines.append(f"  faults while a checkpoint was being assembled: {self.assembly_faults}")
        lines += [f"  note {k}: {v}" for k, vs in self.notes.items() for v in vs]
        if self.evidence:
            lines.append(f"  evidence (logs, Redis state, rank logs, fault timeline): {self.evidence}")
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2, default=str))


#: How long after a fault heals every checkpoint written meanwhile must be READY or FAILED: a lost
#: ShardWritten is published again by its node agent after TRAINYARD_CONFIRM_AFTER_S (10 s).
SETTLE_BOUND_S = 30.0
#: After the broker itself restarted (empty: memory storage), tansu refuses produce requests to a
#: partition for up to ~30 s (see the node agent's relay), so a lost shard report can only be published
#: again after that window, then within TRAINYARD_CONFIRM_AFTER_S + TRAINYARD_CONFIRM_INTERVAL_S (15 s).
BROKER_SETTLE_BOUND_S = 45.0


def settle_bound(kind: str) -> float:
    """The :data:`SETTLE_BOUND_S` that applies after a fault of ``kind``."""
    return BROKER_SETTLE_BOUND_S if kind == "broker" else SETTLE_BOUND_S
#: Faults that, when timed, hit a checkpoint between its first ShardWritten and READY.
ASSEMBLY_KINDS = ("broker", "service:checkpoint-coordinator")


def run_chaos(rig: ChaosRig, plan: list[str], *, max_steps: int, every: int, tmp: Path,
              terminal_timeout_s: float = 300.0, lost_work_slack: int = 0, timed: float = 0.5,
              require_assembly: tuple[str, ...] = (), evidence_dir: Path | None = None) -> ChaosReport:
    """Inject ``plan`` (fault kinds, in order, each at a random moment) into running jobs; check everything.

    A fault of :data:`ASSEMBLY_KINDS` is timed (with probability ``timed``) to strike while a
    checkpoint is being assembled; each kind in ``require_assembly`` is retried (up to 3 more
    times) until one did. After every control-plane fault the run waits until the killed components
    run again and then checks that what was written meanwhile settles within :data:`SETTLE_BOUND_S`.
    """
    try:
        return _run(rig, plan, max_steps=max_steps, every=every, tmp=tmp, terminal_timeout_s=terminal_timeout_s,
                    lost_work_slack=lost_work_slack, timed=timed, require_assembly=require_assembly,
                    evidence_dir=evidence_dir)
    except Exception:
        if evidence_dir is not None:  # the run itself broke: keep what there is, then report the error
            try:
                where = rig.keep_evidence(evidence_dir, rig.jobs, {"error": traceback.format_exc()})
                print(f"\n  chaos run failed; evidence: {where}")
            except Exception as exc:  # noqa: BLE001 - the original error matters more
                print(f"\n  chaos run failed; keeping its evidence failed too: {exc!r}")
        raise


def _run(rig: ChaosRig, plan: list[str], *, max_steps: int, every: int, tmp: Path, terminal_timeout_s: float,
         lost_work_slack: int, timed: float, require_assembly: tuple[str, ...],
         evidence_dir: Path | None) -> ChaosReport:
    started = time.monotonic()
    spec = chaos_spec(max_steps=max_steps, every=every)
    reference = rig.submit({**spec, "name": "reference"})
    current = rig.submit({**spec, "name": "chaos-1"})
    faulted = [current]
    report = ChaosReport()
    plan, retries = list(plan), {k: 3 for k in require_assembly}
    while plan:
        kind = plan.pop(0)
        fault = None
        for _ in range(3):  # the job may finish under our feet: then the next one takes the fault
            current = _running_job(rig, current, faulted, spec)
            rig.wait_running(current, steps_past_start=1)
            # a random moment: a random number of steps further, anywhere in a checkpoint interval
            rig.wait_advance(current, rig.rng.randint(1, every + 2))
            attempt_before, _ = rig.progress(current)
            at_assembly = kind in ASSEMBLY_KINDS and (kind in require_assembly or rig.rng.random() < timed)
            if (fault := _inject(rig, kind, current, at_assembly=at_assembly)) is not None:
                break
        if fault is None:
            continue
        if fault.assembling:
            report.assembly_faults.append(kind)
        elif kind in retries and kind not in report.assembly_faults and retries[kind] > 0:
            retries[kind] -= 1
            plan.insert(0, kind)  # it missed the assembly window: once more, after this one healed
        if kind in ("rank", "hang"):
            attempt, _ = rig.wait_running(current, steps_past_start=1, after_attempt=attempt_before)
            first = _first_step_at(rig, current, attempt)
            if first is not None and kind == "rank":
                report.recovery_s.append(first - fault.at)
        else:
            time.sleep(rig.rng.uniform(0.0, 3.0))  # an outage of random length
            rig.restart_dead()
            bound = settle_bound(kind)
            waited, unsettled = rig.wait_settled(bound)
            fault.settled_s = waited
            report.settle_s.append(waited)
            report.record("settled-after-heal", 1, inv.check_settled_after_heal(kind, unsettled, waited, bound))
            rig.wait_advance(current, 2)
    records = rig.wait_terminal(rig.jobs, terminal_timeout_s)
    report.seconds = time.monotonic() - started
    report.faults = dict(Counter(f"service:{f.target}" if f.kind == "service" else f.kind for f in rig.faults))
    report.timeline = [_timeline_entry(f, started_at=rig.faults[0].at if rig.faults else 0.0) for f in rig.faults]
    check_everything(rig, report, reference=reference, faulted=faulted, max_steps=max_steps, every=every,
                     tmp=tmp, records_seen=records, lost_work_slack=lost_work_slack)
    if report.violation_count and evidence_dir is not None:
        report.evidence = str(rig.keep_evidence(evidence_dir, _named_jobs(report) or rig.jobs, asdict(report)))
    return report


def _timeline_entry(fault: Any, *, started_at: float) -> dict[str, Any]:
    return {"t": round(fault.at - started_at, 2), "kind": fault.kind, "target": fault.target,
            "job": fault.job_id, "step": fault.step, "progress": fault.progress,
            "assembling": fault.assembling,
            "healedAfter": round(fault.healed_at - fault.at, 2) if fault.healed_at else None,
            "settledAfterHeal": round(fault.settled_s, 2) if fault.settled_s is not None else None}


def _named_jobs(report: ChaosReport) -> list[str]:
    return sorted({m for vs in report.violations.values() for v in vs for m in re.findall(r"job-[0-9a-f]{12}", v)})


def _running_job(rig: ChaosRig, current: str, faulted: list[str], spec: dict[str, Any]) -> str:
    """The faulted job, or a fresh one when it has finished (faults need a running job)."""
    record = rig.job(current)
    if record is not None and record.state in TERMINAL_STATES:
        current = rig.submit({**spec, "name": f"chaos-{len(faulted) + 1}"})
        faulted.append(current)
    return current


def _inject(rig: ChaosRig, kind: str, job_id: str, *, at_assembly: bool = False) -> Any:
    if kind == "rank":
        return rig.kill_rank(job_id)
    if kind == "hang":
        return rig.kill_rank(job_id, stop=True)
    if kind == "agent":
        return rig.kill_agent_of(job_id)
    if kind == "redis":
        return rig.kill_component("redis", "redis")
    if kind in ("broker", "service:checkpoint-coordinator"):
        assembling = rig.wait_assembling(job_id) if at_assembly else None
        fault = (rig.kill_component("broker", "broker") if kind == "broker"
                 else rig.kill_component("checkpoint-coordinator", "service"))
        fault.job_id = job_id
        if assembling is not None and rig.checkpoint_state(assembling) != "READY":
            fault.assembling.append(assembling)  # killed between its first ShardWritten and READY
        return fault
    if kind == "services":  # every service and one node agent, in random order, within a second or two
        names = [*SERVICES]
        rig.rng.shuffle(names)
        fault = rig.kill_agent_of(job_id)
        for name in names:
            time.sleep(rig.rng.uniform(0.0, 0.5))
            fault = rig.kill_component(name, "service")
        return fault
    if kind.startswith("service:"):
        return rig.kill_component(kind.split(":", 1)[1], "service")
    raise ValueError(f"unknown fault kind {kind!r}")


def _first_step_at(rig: ChaosRig, job_id: str, attempt: int) -> float | None:
    stamps = [datetime.fromisoformat(p["occurredAt"]).timestamp()
              for lines in rig.spool_events(job_id, attempt).values() for p in lines
              if p.get("eventType") == "StepMetrics"]
    return min(stamps) if stamps else None


def check_everything(rig: ChaosRig, report: ChaosReport, *, reference: str, faulted: list[str], max_steps: int,
                     every: int, tmp: Path, records_seen: dict[str, Any], lost_work_slack: int = 0) -> None:
    """Every invariant of docs/design.md §6 over the run's history; results go into ``report``."""
    jobs, checkpoints, audit = rig.history()
    report.jobs = {j: r.state for j, r in jobs.items()}
    record = report.record
    record("terminal", len(rig.jobs), inv.check_terminal(jobs.values())
           + [f"job {j} has no record" for j in rig.jobs if j not in jobs])
    record("no-double-booking", len(audit), inv.check_no_double_booking(audit))
    record("leases-released", len(audit), inv.check_leases_released(audit, jobs.values()))
    record("fencing", sum(len(c) for c in checkpoints.values()), inv.check_fencing(jobs.values(), checkpoints))
    all_ready = [c for cs in checkpoints.values() for c in cs if c.state == "READY"]

    def read(uri: str) -> bytes | None:
        try:
            return uri_to_path(uri).read_bytes()
        except OSError:
            return None

    record("ready-verified", len(all_ready), inv.check_ready_checkpoints(
        all_ready, read_manifest=read, stat_size=local_stat_size, file_sha256=local_sha256))
    for job in jobs.values():
        summaries = rig.attempt_summaries(job)
        record("resumed-from-latest-ready", len(job.attempts),
               inv.check_resumed_from_latest_ready(job, checkpoints.get(job.job_id, [])))
        pairs = [(a, b) for a, b in zip(summaries, summaries[1:], strict=False) if a.state == "failed"]
        for failed, nxt in pairs:
            if failed.last_step is not None:
                report.lost_steps.append((failed.last_step - nxt.start_step, every))
            # one interval, plus the steps of the one save still in flight at the failure
            record("lost-work", 1, inv.check_lost_work(job.job_id, [failed, nxt], every, slack=lost_work_slack))
    ref = jobs.get(reference)
    if ref is None or ref.state != "succeeded":
        record("bitwise-identical", 1, [f"the reference job {reference} did not succeed: "
                                        f"{ref.state if ref else 'missing'} {ref.reason if ref else ''}"])
        return
    ref_state = rig.final_state(reference, checkpoints[reference], max_steps, tmp)
    for job_id in faulted:
        job = jobs.get(job_id)
        if job is None or job.state != "succeeded":
            record("bitwise-identical", 1, [f"faulted job {job_id} did not succeed: {job.state if job else '?'} "
                                            f"{job.reason if job else ''}"])
            continue
        state = rig.final_state(job_id, checkpoints[job_id], max_steps, tmp)
        record("bitwise-identical", 1, [f"{job_id}: {p}" for p in inv.check_bitwise_identical(ref_state, state)])
        if len(job.attempts) > 1:
            report.notes.setdefault("resumed jobs compared bitwise", []).append(
                f"{job_id}: {len(job.attempts)} attempts "
                f"({', '.join(a.failure_reason or a.state for a in job.attempts)})")
