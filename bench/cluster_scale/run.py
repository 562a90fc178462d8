"""The live control plane at cluster scale: simulated nodes on the real bus (a benchmark: it prints figures).

    python bench/cluster_scale/run.py [--nodes 256,1024,4096] [--jobs-per-node 2.44] [--rate 200]
                                      [--steady-s 60] [--quick] [--json out.json] [--plot out.svg]

For each cluster size a private stack runs the real services — broker, Redis, API, scheduler, telemetry,
checkpoint coordinator, registry, Prometheus — with no node agent: ``simnodes.py`` (one process) stands in for
every node (heartbeats with racks and NVLink domains, the allocations read and their ranks started, StepMetrics
from every running rank at ``--step-hz``; see its docstring). Then, in the same run:

    baseline   the broker's own produce → consume round trip; GET /healthz of the same API under the same load
    (1) idle   sequential 1-device submissions on the idle cluster: POST sent → GangAllocated, and 202 →
               GangAllocated (each cancelled and gone before the next)
    (2) load   ``jobs-per-node × nodes`` jobs (10,000 at 4,096 nodes) of mixed sizes (1 to 512 devices), four
               priorities, two tenants with quotas, in an open loop at ``--rate`` POSTs a second: POST p50/p99
               (and /healthz's beside it), accepted, errors. The first jobs fill the cluster; the rest queue
    (3) steady ``--steady-s`` seconds with the cluster full and the queue deep: the scheduler's passes (its own
               histogram, by phase: snapshot, plan — the pure decisions — apply, total) p50/p99 and decisions/s;
               StepMetrics produced and ingested a second and the telemetry consumer's lag at the start and end;
               the dashboard's queries (a job's metric history, the cluster view) p50/p99
    (4) memory every process's RSS; Redis' memory per node (the inventory) and per job (the queue)
    (5) leader a standby scheduler started, the leader stopped (SIGTERM: it resigns, as in a rolling upgrade);
               the standby's snapshot rebuild, and the time from the stop to the next GangAllocated (a running job is
               cancelled at the same moment, so a queued job can be placed)

A plot of the cost against the cluster size (pass p99, snapshot rebuild, RSS, Redis per node) is written as SVG.
Targets (design.md "Scale"; printed beside the figures, not asserted): pass p99 ≤ 100 ms at 4,096 nodes and
10,000 queued; 202 → GangAllocated p99 ≤ 10 ms idle; 200 POST/s with p99 ≤ 50 ms; 30,000 StepMetrics/s with no
growing lag; every service ≤ 2 GiB; a leader change placing again within 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition
from redis.asyncio import Redis

from trainyard_cli import infra, observe
from trainyard_cli.stack import LocalStack
from trainyard_contract.events import METRICS
from trainyard_runtime.store import Keys

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
from tests.support.stack import local_stack  # noqa: E402 - the stack the e2e tests and benchmarks share
_spec = importlib.util.spec_from_file_location("control_plane_bench", REPO / "bench" / "control_plane" / "run.py")
assert _spec is not None and _spec.loader is not None
cp = importlib.util.module_from_spec(_spec)
sys.modules["control_plane_bench"] = cp  # its dataclasses look their module up
_spec.loader.exec_module(cp)

DEVICE = "h100-80gb"
SIZES = ((1, 10), (2, 6), (4, 8), (8, 20), (16, 14), (32, 12), (64, 10), (128, 8), (256, 6), (512, 6))
PRIORITIES = ((-100, 20), (0, 60), (100, 15), (1000, 5))
TENANTS = ("team-a", "team-b")
TARGETS = {"pass_p99_ms": 100.0, "allocated_p99_ms": 10.0, "post_p99_ms": 50.0, "rate": 200.0,
           "steps_per_s": 30000.0, "rss_mib": 2048.0, "leader_s": 2.0}


# ----------------------------------------------------------------------------- figures (pure)


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs, +Inf last; None if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            return prev_bound + (bound - prev_bound) * ((rank - prev_count) / max(count - prev_count, 1e-12))
        prev_bound, prev_count = bound, count
    return prev_bound


def parse_metrics(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Prometheus text → name → labels → value."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)", line)
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(3) or "")))
        out.setdefault(m.group(1), {})[labels] = float(m.group(4))
    return out


def histogram_delta(before: dict, after: dict, name: str, match: dict[str, str]) -> dict[str, Any]:
    """p50/p99 (ms), count and sum of a histogram's observations between two scrapes, for the labels ``match``."""
    def cumulative(scrape: dict) -> dict[float, float]:
        got: dict[float, float] = {}
        for labels, value in scrape.get(f"{name}_bucket", {}).items():
            d = dict(labels)
            if all(d.get(k) == v for k, v in match.items()):
                got[float(d["le"])] = value
        return got

    a, b = cumulative(after), cumulative(before)
    pairs = sorted((le, a[le] - b.get(le, 0.0)) for le in a)

    def scalar(scrape: dict, suffix: str) -> float:
        return sum(v for labels, v in scrape.get(f"{name}_{suffix}", {}).items()
                   if all(dict(labels).get(k) == want for k, want in match.items()))

    count = scalar(after, "count") - scalar(before, "count")
    total = scalar(after, "sum") - scalar(before, "sum")
    p50, p99 = histogram_quantile(pairs, 0.5), histogram_quantile(pairs, 0.99)
    return {"count": int(count), "mean_ms": total / count * 1000 if count else None,
            "p50_ms": None if p50 is None else p50 * 1000, "p99_ms": None if p99 is None else p99 * 1000}


def counter_delta(before: dict, after: dict, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in after.get(name, {}).items():
        out[",".join(v for _, v in labels)] = value - before.get(name, {}).get(labels, 0.0)
    return out


def job_spec(i: int, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A job of the mixed queue: (tenant, spec)."""
    sizes, weights = zip(*SIZES, strict=True)
    size = rng.choices(sizes, weights)[0]
    prios, pweights = zip(*PRIORITIES, strict=True)
    spec = cp.tiny_spec()
    spec.update(name=f"scale-{i}", priority=rng.choices(prios, pweights)[0],
                resources={"gpuType": DEVICE, "gpuCount": size},
                parallelism={"data": size, "tensor": 1, "pipeline": 1},
                checkpointPolicy={"everySteps": 100000, "keepLast": 1})
    spec["training"] = {**spec["training"], "microBatchSize": 1, "globalBatchSize": size, "maxSteps": 10_000_000}
    return TENANTS[i % 2], spec


def one_device_spec(name: str) -> dict[str, Any]:
    spec = cp.tiny_spec()
    spec.update(name=name, priority=1000, resources={"gpuType": DEVICE, "gpuCount": 1},
                parallelism={"data": 1, "tensor": 1, "pipeline": 1})
    spec["training"] = {**spec["training"], "microBatchSize": 8, "globalBatchSize": 8, "maxSteps": 10_000_000}
    return spec


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------- the stack and the simulator


@contextmanager
def scale_stack() -> Iterator[LocalStack]:
    """The control plane alone (no node agent), with Prometheus (so every service has a metrics port)."""
    root = Path(tempfile.mkdtemp(prefix="trainyard-bench-scale-"))
    try:
        with local_stack(root / ".trainyard", nodes=0, drain_timeout_s=0, prometheus=True,
                         prometheus_port=infra.free_port()) as stack:
            yield stack
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Sim:
    process: subprocess.Popen[str]
    last: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, stack: LocalStack, nodes: int, step_hz: float, checkpoint_every: int) -> Sim:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        agent = stack.service_env("node-agent")
        cmd = [sys.executable, str(HERE / "simnodes.py"), "--bootstrap", stack.kafka_bootstrap,
               "--redis-url", agent["TRAINYARD_REDIS_URL"], "--artifacts", agent["TRAINYARD_ARTIFACT_ROOT"],
               "--checkpoint-every", str(checkpoint_every), "--nodes", str(nodes), "--step-hz", str(step_hz)]
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env)
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"simnodes did not start: {line!r}")
        sim = cls(process)
        asyncio.get_event_loop_policy()  # the reader thread below updates ``last``
        import threading

        def read() -> None:
            for text in process.stdout:  # type: ignore[union-attr]
                try:
                    sim.last = json.loads(text)
                except ValueError:
                    pass

        threading.Thread(target=read, daemon=True).start()
        return sim

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def metrics_url(stack: LocalStack, component: str) -> str:
    target = json.loads((observe.targets_dir(stack.s.root) / f"{component}.json").read_text())
    return f"http://{target[0]['targets'][0]}/metrics"


async def scrape(stack: LocalStack, component: str) -> dict:
    token = observe.metrics_token(stack.s.root)
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(metrics_url(stack, component), headers={"authorization": f"Bearer {token}"})
        r.raise_for_status()
        return parse_metrics(r.text)


def pids(stack: LocalStack) -> dict[str, int]:
    return {c.name: c.pid for c in stack.running() if c.pid}


# ----------------------------------------------------------------------------- phases


async def tenants(api_url: str, admin_token: str, devices: int) -> dict[str, str]:
    """Two tenants, each guaranteed half the devices and allowed to borrow a quarter more: their tokens."""
    tokens: dict[str, str] = {}
    async with httpx.AsyncClient(base_url=api_url, timeout=30,
                                 headers={"authorization": f"Bearer {admin_token}"}) as admin:
        for name in TENANTS:
            quota = {DEVICE: {"guaranteed": devices // 2, "borrowLimit": devices // 4}}
            r = await admin.post("/v1/admin/tenants", json={"tenant": name, "quotas": quota})
            r.raise_for_status()
            r = await admin.post(f"/v1/admin/tenants/{name}/tokens", json={"name": "bench", "role": "submitter"})
            r.raise_for_status()
            tokens[name] = r.json()["token"]
    return tokens


async def idle_placement(stack: LocalStack, token: str, samples: int) -> dict[str, Any]:
    """(1): sequential 1-device jobs on the idle cluster; the broker's round trip as the baseline."""
    rtt = await cp.broker_round_trip(stack.kafka_bootstrap, stack.s.topic_namespace, samples)
    watch = await cp.EventWatch.start(stack.kafka_bootstrap, stack.s.topic_namespace)
    try:
        async with httpx.AsyncClient(base_url=stack.s.api_url, timeout=30,
                                     headers={"authorization": f"Bearer {token}"}) as api:
            sent_to, after_202, missed = await cp.placement(api, watch, samples, spec=one_device_spec)
    finally:
        await watch.stop()
    baseline = cp.summary_ms(rtt)
    fig = cp.summary_ms(after_202)
    return {"broker_rtt_ms": baseline, "post_to_allocated_ms": cp.summary_ms(sent_to),
            "accepted_to_allocated_ms": {**fig, "ratio_to_broker": cp.ratios(fig, baseline)}, "missed": missed}


@dataclass
class Load(cp.Sustained):  # type: ignore[name-defined]  # the control-plane benchmark's, loaded by path
    healthz: list[float] = field(default_factory=list)


async def submit_load(api_url: str, tokens: dict[str, str], jobs: int, rate: float, seed: int = 7) -> dict[str, Any]:
    """(2): the open loop of submissions (each POST at its moment; latency from that moment), with a GET /healthz
    of the same API every tenth moment as the baseline."""
    rng = random.Random(seed)
    out = Load()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    clients = {t: httpx.AsyncClient(base_url=api_url, timeout=60, limits=limits,
                                    headers={"authorization": f"Bearer {tok}"}) for t, tok in tokens.items()}

    async def one(i: int, due: float) -> None:
        tenant, spec = job_spec(i, rng)
        await cp.post_job(clients[tenant], spec, due, out)

    async def probe(due: float) -> None:
        try:
            r = await clients[TENANTS[0]].get("/healthz")
        except httpx.HTTPError as exc:
            out.errors[f"healthz {type(exc).__name__}"] = out.errors.get(f"healthz {type(exc).__name__}", 0) + 1
            return
        if r.status_code == 200:
            out.healthz.append(time.monotonic() - due)

    start = time.monotonic()
    tasks = []
    for n in range(jobs):
        due = start + n / rate
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(one(n, due)))
        if n % 10 == 5:
            tasks.append(asyncio.create_task(probe(time.monotonic())))
    await asyncio.gather(*tasks)
    took = time.monotonic() - start
    for client in clients.values():
        await client.aclose()
    post, healthz = cp.summary_ms(out.post), cp.summary_ms(out.healthz)
    return {"jobs": jobs, "rate": rate, "achieved_rate": len(out.accepted) / took, "accepted": len(out.accepted),
            "errors": out.errors, "post_ms": {**post, "ratio_to_healthz": cp.ratios(post, healthz)},
            "healthz_ms": healthz, "job_ids": out.accepted}


async def consumer_lag(bootstrap: str, topic: str, group: str) -> int:
    """Records of ``topic`` the group has not committed yet (a consumer of the group's id that never joins it:
    only its committed offsets are read)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()  # noqa: SLF001 - aiokafka exposes no other way
        parts = [TopicPartition(topic, p) for p in (consumer.partitions_for_topic(topic) or set())]
        ends = await consumer.end_offsets(parts)
        lag = 0
        for tp in parts:
            committed = await consumer.committed(tp)
            lag += ends[tp] - (committed or 0)
        return lag
    finally:
        await consumer.stop()


async def queries(api_url: str, token: str, job_ids: list[str], seconds: float) -> dict[str, Any]:
    """The dashboard's reads under the load, one after another: a running job's metric history, the cluster."""
    times: dict[str, list[float]] = {"metrics": [], "cluster": []}
    async with httpx.AsyncClient(base_url=api_url, timeout=60, headers={"authorization": f"Bearer {token}"}) as api:
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            path = f"/v1/training-jobs/{job_ids[i % len(job_ids)]}/metrics" if i % 4 else "/v1/cluster"
            kind = "metrics" if i % 4 else "cluster"
            t = time.monotonic()
            r = await api.get(path)
            if r.status_code == 200:
                times[kind].append(time.monotonic() - t)
            i += 1
            await asyncio.sleep(0.05)
    return {k: cp.summary_ms(v) for k, v in times.items()}


async def redis_used(url: str) -> int:
    redis = Redis.from_url(url)
    try:
        return int((await redis.info("memory"))["used_memory"])
    finally:
        await redis.aclose()


async def wait_settled(sim: Sim, timeout_s: float, quiet_s: float = 8.0) -> float:
    """Until the simulated nodes started no rank for ``quiet_s`` (the cluster is as full as the queue makes it)."""
    start = time.monotonic()
    last, since = sim.last.get("started"), time.monotonic()
    while time.monotonic() - start < timeout_s:
        await asyncio.sleep(1.0)
        now = sim.last.get("started")
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return time.monotonic() - start


async def steady(stack: LocalStack, sim: Sim, token: str, job_ids: list[str], seconds: float) -> dict[str, Any]:
    """(3): the passes, the StepMetrics stream and the dashboard's reads, over ``seconds`` of the full cluster."""
    topic, group = f"{stack.s.topic_namespace}{METRICS}", "trainyard.telemetry-metrics"
    before, lag0, steps0, t0 = await scrape(stack, "scheduler"), \
        await consumer_lag(stack.kafka_bootstrap, topic, group), sim.last.get("steps", 0), time.monotonic()
    ckpt0, shards0 = await scrape(stack, "checkpoint-coordinator"), sim.last.get("shards", 0)
    reads = await queries(stack.s.api_url, token, job_ids, seconds)
    after, lag1, steps1, t1 = await scrape(stack, "scheduler"), \
        await consumer_lag(stack.kafka_bootstrap, topic, group), sim.last.get("steps", 0), time.monotonic()
    ckpt1, shards1 = await scrape(stack, "checkpoint-coordinator"), sim.last.get("shards", 0)
    settled = counter_delta(ckpt0, ckpt1, "trainyard_checkpoints_total")
    produced = (steps1 - steps0) / (t1 - t0)
    passes = {phase: histogram_delta(before, after, "trainyard_scheduler_pass_seconds", {"phase": phase})
              for phase in ("reconcile", "snapshot", "plan", "apply", "total")}
    decisions = counter_delta(before, after, "trainyard_scheduler_decisions_total")
    pending = sum(after.get("trainyard_scheduler_pending_jobs", {}).values())
    return {"seconds": t1 - t0, "pending": int(pending), "passes": passes,
            "passes_per_s": passes["total"]["count"] / (t1 - t0),
            "decisions_per_s": sum(decisions.values()) / (t1 - t0), "decisions": decisions,
            "steps_produced_per_s": produced, "steps_ingested_per_s": produced - (lag1 - lag0) / (t1 - t0),
            "telemetry_lag": {"start": lag0, "end": lag1}, "reads_ms": reads,
            "shards_per_s": (shards1 - shards0) / (t1 - t0),
            "checkpoints": settled}


def memory(stack: LocalStack, sim: Sim) -> dict[str, float | None]:
    out = {name: rss_mib(pid) for name, pid in pids(stack).items()}
    out["simnodes"] = rss_mib(sim.process.pid)
    return out


async def leader_change(stack: LocalStack, tokens: dict[str, str], job_ids: list[str]) -> dict[str, Any]:
    """(5): a standby started; the leader stopped (SIGTERM: it resigns) as a running job is cancelled: the time to
    a new leader, its snapshot rebuild, and the time from the stop to the first GangAllocated after the new
    leader took over (the cancelled job's devices placed again)."""
    stack._spawn_service("scheduler", name="scheduler-standby")  # noqa: SLF001 - the stack's own spawner
    redis = Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len([k async for k in redis.scan_iter(match="ty:health:scheduler:*")]) >= 2:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(3.0)  # the standby's consumers joined
        before = await redis.get(Keys.sched_leader) or ""
        standby0 = await scrape(stack, "scheduler-standby")
        watch = await cp.EventWatch.start(stack.kafka_bootstrap, stack.s.topic_namespace)
        leader = next(c for c in stack.running() if c.name == "scheduler")
        running = await running_job(stack.s.api_url, tokens, job_ids)
        stopped = time.monotonic()
        os.kill(leader.pid, signal.SIGTERM)
        if running is not None:
            tenant, job_id = running
            async with httpx.AsyncClient(base_url=stack.s.api_url, timeout=30,
                                         headers={"authorization": f"Bearer {tokens[tenant]}"}) as api:
                await api.post(f"/v1/training-jobs/{job_id}/cancel")
        elected = None
        while time.monotonic() - stopped < 60 and elected is None:
            now = await redis.get(Keys.sched_leader) or ""
            if now and now.split()[-1] != before.split()[-1]:
                elected = time.monotonic()
            await asyncio.sleep(0.02)
        rebuild: dict[str, Any] = {"count": 0, "mean_ms": None}  # the new leader's first pass comes first
        while elected is not None and time.monotonic() - stopped < 60 and not rebuild["count"]:
            rebuild = histogram_delta(standby0, await scrape(stack, "scheduler-standby"),
                                      "trainyard_scheduler_takeover_seconds", {})
            await asyncio.sleep(0.2)
        placed = None  # (None when nothing the queue holds fits the freed devices within the minute)
        while elected is not None and time.monotonic() - stopped < 60 and placed is None:
            after = [t for t in watch.allocated.values() if t >= elected]
            placed = min(after) - stopped if after else None
            await asyncio.sleep(0.05)
        await watch.stop()
        return {"stop_to_new_leader_s": None if elected is None else elected - stopped,
                "stop_to_next_allocation_s": placed, "standby_rebuild_ms": rebuild["mean_ms"],
                "cancelled": running[1] if running else None}
    finally:
        await redis.aclose()


async def running_job(api_url: str, tokens: dict[str, str], job_ids: list[str]) -> tuple[str, str] | None:
    for tenant, token in tokens.items():
        async with httpx.AsyncClient(base_url=api_url, timeout=30, headers={"authorization": f"Bearer {token}"}) as api:
            page = (await api.get("/v1/training-jobs", params={"limit": 500, "state": "running"})).json()
            for job in page.get("jobs", []):
                if job.get("state") == "running":
                    return tenant, job["jobId"]
    return None


# ----------------------------------------------------------------------------- where the time goes


def profile_start(stack: LocalStack, out: Path | None, phase: str, seconds: float) -> list[subprocess.Popen[bytes]]:
    """py-spy (sampling, from outside) on the API, the scheduler and the telemetry service for ``seconds``."""
    if out is None or shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).parent / "py-spy")
    procs = []
    for name, pid in pids(stack).items():
        if name in ("api", "scheduler", "telemetry"):
            procs.append(subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50", "--format", "raw",
                 "--nonblocking", "--output", str(out / f"{phase}-{name}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def profile_summary(path: Path, top: int = 12) -> list[str]:
    """The functions a collapsed-stack profile spends its samples in (inclusive, trainyard's and the libraries'
    frames by file:function), the largest first."""
    inclusive: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        seen = set()
        for frame in stack.split(";"):
            m = re.match(r"^(.*?) \((.*?)(?::\d+)?\)$", frame)
            key = f"{Path(m.group(2)).name}:{m.group(1)}" if m else frame
            if key not in seen:
                seen.add(key)
                inclusive[key] = inclusive.get(key, 0) + n
    ranked = sorted(inclusive.items(), key=lambda kv: -kv[1])
    skip = ("<module>", "run", "run_forever", "_run_once", "_run", "main", "run_until_complete", "serve",
            "__call__", "wrapper")
    lines = [f"{path.name}: {total} samples"]
    for key, n in ranked:
        if key.rsplit(":", 1)[-1] in skip:
            continue
        lines.append(f"  {n / max(total, 1) * 100:5.1f}%  {key}")
        if len(lines) > top:
            break
    return lines


# ----------------------------------------------------------------------------- one cluster size


async def one_size(stack: LocalStack, token: str, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    empty = await redis_used(stack.redis_url)
    sim = Sim.start(stack, nodes, args.step_hz, args.checkpoint_every)
    try:
        await wait_inventory(stack.redis_url, nodes, timeout_s=max(120.0, nodes * 0.1))
        with_nodes = await redis_used(stack.redis_url)
        idle = await idle_placement(stack, token, args.samples)
        tokens = await tenants(stack.s.api_url, stack.admin_token_file.read_text().strip(), nodes * 8)
        jobs = int(round(args.jobs_per_node * nodes))
        spies = profile_start(stack, args.profile, f"{nodes}-load", min(20.0, jobs / args.rate))
        load = await submit_load(stack.s.api_url, tokens, jobs, args.rate)
        settle_s = await wait_settled(sim, args.settle)
        with_jobs = await redis_used(stack.redis_url)
        job_ids = load.pop("job_ids")
        spies += profile_start(stack, args.profile, f"{nodes}-steady", min(20.0, args.steady_s))
        state = await steady(stack, sim, tokens[TENANTS[0]], job_ids[:200:2], args.steady_s)
        for spy in spies:
            spy.wait()
        rss = memory(stack, sim)
        leader = await leader_change(stack, tokens, job_ids)
        return {"nodes": nodes, "devices": nodes * 8, "jobs": jobs, "idle": idle, "load": load,
                "fill_s": settle_s, "steady": state, "rss_mib": rss, "leader": leader, "sim": sim.last,
                "redis": {"empty_mib": empty / 2**20, "per_node_kib": (with_nodes - empty) / nodes / 1024,
                          "per_job_kib": (with_jobs - with_nodes) / max(jobs, 1) / 1024}}
    finally:
        sim.stop()


async def wait_inventory(redis_url: str, nodes: int, timeout_s: float = 120.0) -> None:
    redis = Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while await redis.hlen("ty:nodes") < nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler recorded {await redis.hlen('ty:nodes')}/{nodes} nodes")
            await asyncio.sleep(0.5)
    finally:
        await redis.aclose()


# ----------------------------------------------------------------------------- report


def fmt(value: Any, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def report_lines(results: list[dict[str, Any]]) -> list[str]:
    """The table: one column per cluster size, the target beside."""
    rows: list[tuple[str, str, Any]] = []

    def row(label: str, target: str, pick: Any) -> None:
        rows.append((label, target, [pick(r) for r in results]))

    row("scheduling pass p50 (ms)", "", lambda r: fmt(r["steady"]["passes"]["total"]["p50_ms"]))
    row("scheduling pass p99 (ms)", "≤ 100", lambda r: fmt(r["steady"]["passes"]["total"]["p99_ms"]))
    row("  of which plan p99 (pure, ms)", "", lambda r: fmt(r["steady"]["passes"]["plan"]["p99_ms"]))
    row("  of which snapshot p99 (ms)", "", lambda r: fmt(r["steady"]["passes"]["snapshot"]["p99_ms"]))
    row("  of which apply p99 (ms)", "", lambda r: fmt(r["steady"]["passes"]["apply"]["p99_ms"]))
    row("  reconcile, when due, p99 (ms)", "", lambda r: fmt(r["steady"]["passes"]["reconcile"]["p99_ms"]))
    row("decisions/s", "", lambda r: fmt(r["steady"]["decisions_per_s"], 0))
    row("jobs pending in the pass", "", lambda r: f"{r['steady']['pending']:,}")
    row("202 → GangAllocated p99 idle (ms)", "≤ 10",
        lambda r: fmt(r["idle"]["accepted_to_allocated_ms"]["p99"]))
    row("  broker round trip p99 (ms)", "", lambda r: fmt(r["idle"]["broker_rtt_ms"]["p99"]))
    row("POST /v1/training-jobs p50 (ms)", "", lambda r: fmt(r["load"]["post_ms"]["p50"]))
    row("POST /v1/training-jobs p99 (ms)", "≤ 50", lambda r: fmt(r["load"]["post_ms"]["p99"]))
    row("  GET /healthz p99 beside (ms)", "", lambda r: fmt(r["load"]["healthz_ms"]["p99"]))
    row("submissions/s achieved", "≥ 200", lambda r: fmt(r["load"]["achieved_rate"]))
    row("StepMetrics produced/s", "", lambda r: fmt(r["steady"]["steps_produced_per_s"], 0))
    row("StepMetrics ingested/s", "≥ 30,000", lambda r: fmt(r["steady"]["steps_ingested_per_s"], 0))
    row("telemetry lag start → end", "flat", lambda r: "{start:,} → {end:,}".format(**r["steady"]["telemetry_lag"]))
    row("shards reported/s (simulated ranks)", "", lambda r: fmt(r["steady"].get("shards_per_s"), 0))
    row("checkpoints READY / FAILED in the steady phase", "",
        lambda r: "{:,.0f} / {:,.0f}".format(r["steady"].get("checkpoints", {}).get("ready", 0),
                                            r["steady"].get("checkpoints", {}).get("failed", 0)))
    row("job metrics query p99 (ms)", "", lambda r: fmt(r["steady"]["reads_ms"]["metrics"]["p99"]))
    row("cluster view query p99 (ms)", "", lambda r: fmt(r["steady"]["reads_ms"]["cluster"]["p99"]))
    for name in ("api", "scheduler", "telemetry", "checkpoint-coordinator", "registry", "redis", "broker",
                 "simnodes"):
        row(f"RSS {name} (MiB)", "≤ 2,048" if name not in ("redis", "broker", "simnodes") else "",
            lambda r, n=name: fmt(r["rss_mib"].get(n), 0))
    row("Redis per node (KiB)", "", lambda r: fmt(r["redis"]["per_node_kib"]))
    row("Redis per job (KiB)", "", lambda r: fmt(r["redis"]["per_job_kib"]))
    row("new leader's first pass (ms)", "", lambda r: fmt(r["leader"]["standby_rebuild_ms"]))
    row("leader stop → new leader (s)", "", lambda r: fmt(r["leader"]["stop_to_new_leader_s"], 2))
    row("leader stop → next allocation (s)", "≤ 2", lambda r: fmt(r["leader"]["stop_to_next_allocation_s"], 2))
    head = ["figure", "target", *[f"{r['nodes']:,} nodes" for r in results]]
    table = [head, *[[label, target, *cells] for label, target, cells in rows]]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(head))]
    return ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
            for line in table]


def svg_plot(results: list[dict[str, Any]]) -> str:
    """Cost against cluster size, each series relative to its value at the smallest size (log-log)."""
    import math

    series = {
        "pass p99": [r["steady"]["passes"]["total"]["p99_ms"] for r in results],
        "plan p99": [r["steady"]["passes"]["plan"]["p99_ms"] for r in results],
        "takeover pass": [r["leader"]["standby_rebuild_ms"] for r in results],
        "scheduler RSS": [r["rss_mib"].get("scheduler") for r in results],
        "Redis used": [r["redis"]["per_node_kib"] * r["nodes"] + r["redis"]["per_job_kib"] * r["jobs"]
                       for r in results],
    }
    colours = ["#d62728", "#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd"]
    xs = [r["nodes"] for r in results]
    w, h, pad = 640, 400, 60
    x0, x1 = math.log2(min(xs)), math.log2(max(xs)) if len(xs) > 1 else math.log2(min(xs)) + 1
    ratios_all = [v / s[0] for s in series.values() if s[0] for v in s if v]
    top = max([*ratios_all, xs[-1] / xs[0], 2.0])

    def px(x: float) -> float:
        return pad + (math.log2(x) - x0) / max(x1 - x0, 1e-9) * (w - 2 * pad)

    def py(ratio: float) -> float:
        return h - pad - math.log2(max(ratio, 1.0)) / math.log2(top) * (h - 2 * pad)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{pad}" y="20" font-size="14">Cost against cluster size (× its value at {xs[0]:,} nodes)</text>',
           f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>',
           '<polyline fill="none" stroke="#999" stroke-dasharray="4 3" points="'
           + " ".join(f"{px(x):.1f},{py(x / xs[0]):.1f}" for x in xs) + '"/>',
           f'<text x="{w - pad - 110}" y="{py(xs[-1] / xs[0]) - 6:.1f}" fill="#999">linear in nodes</text>']
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{h - pad + 18}" text-anchor="middle">{x:,}</text>')
    for k in range(int(math.log2(top)) + 1):
        out.append(f'<text x="{pad - 8}" y="{py(2 ** k) + 4:.1f}" text-anchor="end">{2 ** k}×</text>')
    for i, (name, values) in enumerate(series.items()):
        pts = [(x, v / values[0]) for x, v in zip(xs, values, strict=True) if v and values[0]]
        if pts:
            out.append(f'<polyline fill="none" stroke-width="2" stroke="{colours[i]}" points="'
                       + " ".join(f"{px(x):.1f},{py(r):.1f}" for x, r in pts) + '"/>')
        out.append(f'<text x="{pad + 10}" y="{pad + 16 * i}" fill="{colours[i]}">{name}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 15}" text-anchor="middle">nodes (8 devices each; queued jobs in '
               f'proportion)</text></svg>')
    return "\n".join(out)


# ----------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="256,1024,4096", help="cluster sizes, comma-separated")
    p.add_argument("--jobs-per-node", type=float, default=10_000 / 4096, help="queued jobs per node")
    p.add_argument("--rate", type=float, default=200.0, help="submissions a second in the open loop")
    p.add_argument("--step-hz", type=float, default=1.0, help="steps a second each running rank reports")
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="steps between a simulated rank's shards (100 s at --step-hz 1)")
    p.add_argument("--samples", type=int, default=50, help="idle placements measured")
    p.add_argument("--steady-s", type=float, default=60.0, help="seconds of the steady phase")
    p.add_argument("--settle", type=float, default=600.0, help="at most this long for the cluster to fill")
    p.add_argument("--quick", action="store_true", help="256 nodes, 10 samples, 15 s steady (the smoke test)")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="run nothing: print the table and plot the curves of earlier runs' --json files")
    p.add_argument("--profile", type=Path, help="also sample the API, scheduler and telemetry with py-spy while "
                                                "loaded; collapsed stacks and a summary here")
    p.add_argument("--plot", type=Path, default=Path("bench-cluster-scale.svg"), help="the SVG plot")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.samples, args.steady_s = "256", 10, 15.0
    return args


def _interrupted(signum: int, frame: Any) -> None:
    """SIGTERM (a timeout, a CI cancel) unwinds like Ctrl-C: the private stack and the simulated nodes stop."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    results: list[dict[str, Any]] = []
    if args.merge:  # the table and the plot of earlier runs' --json files (sizes measured apart), nothing run
        for path in args.merge:
            results += json.loads(path.read_text())
        results.sort(key=lambda r: r["nodes"])
        print("\n".join(report_lines(results)), flush=True)
        args.plot.write_text(svg_plot(results))
        print(f"plot: {args.plot}")
        return 0
    for nodes in [int(n) for n in args.nodes.split(",")]:
        print(f"— {nodes:,} simulated nodes × 8 devices, {int(round(args.jobs_per_node * nodes)):,} jobs …",
              flush=True)
        try:
            with scale_stack() as stack:
                token = stack.tokens.when_the_api_answers(stack.s.api_url)
                result = asyncio.run(one_size(stack, token, nodes, args))
        except RuntimeError as exc:  # this size could not be measured here: say why, keep the others
            print(f"{nodes:,} nodes: not measured: {exc}", file=sys.stderr, flush=True)
            continue
        results.append(result)
        print("\n".join(report_lines(results)), flush=True)
        if args.json:  # after every size: a later size that fails loses nothing
            args.json.write_text(json.dumps(results, indent=1, default=str))
    if not results:
        return 1
    args.plot.write_text(svg_plot(results))
    if args.profile:
        for path in sorted(args.profile.glob("*.txt")):
            print("\n".join(profile_summary(path)))
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
