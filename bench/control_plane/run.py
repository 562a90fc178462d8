"""Control-plane latency and throughput on the local stack (a benchmark: it prints figures, never fails).

    python bench/control_plane/run.py [--submissions 100] [--rate 50] [--seconds 60] [--samples 200]
                                      [--quick] [--json results.json]

A private local stack (LocalStack: the broker, Redis, the services, 2 node agents × 4 CPU devices; free
ports, a temporary directory, tinycorpus@v1 published) is started, and in the same run:

    baseline       a bare aiokafka produce → consume round trip on the same broker (its own 1-partition
                   topic, created with aiokafka's admin client: tansu creates no topic by itself)
    (1) placement  ``--submissions`` sequential submissions of a 1-device job on the idle cluster: the time
                   from sending the POST (its own round trip included: the GangAllocated often arrives before
                   the 202 does) to the GangAllocated event with that jobId; also from the 202's arrival (read by an
                   aiokafka consumer of its own group, at the latest offset, started before the first submission). Each
                   job is cancelled right after its GangAllocated and the next one is submitted once it is terminal and
                   its rank has exited (a warm interpreter starts it within ~0.1 s: WorkerStarted = WorkerExited on
                   trainyard.workers), so the cluster is idle at every submission (one uncounted warm-up first)
    (2) sustained  an open loop of POSTs at ``--rate``/s for ``--seconds`` s (each POST is sent at its
                   scheduled moment, whatever the earlier ones are doing; its latency counts from that
                   moment). The jobs ask for more devices than the cluster has, so they are accepted and
                   stay queued: the two cores go to the control plane, not to ranks (``--placeable``:
                   1-device jobs, placed as devices free up, their ranks running here). Afterwards every
                   accepted job is cancelled; the run waits until each is terminal and listed
                   (GET /v1/training-jobs, every page). lost = accepted − listed, which must be 0
    (3) first step examples/tiny.yaml: the 202 response → its first StepMetrics on the metrics topic

Before each phase the run waits until the host's CPU has been quiet (under half a core busy) for 8 s in a
row (at most 180 s): the node agents refill their warm interpreters in the background (importing torch, seconds of
CPU each) once no rank has started or ended for 5 s, and on this 2-core machine that would be measured too.

Every figure is also given as a ratio to the broker round trip (p50 to p50, p99 to p99). ``--quick`` is
a short run (few samples, a 10 s open loop) for the smoke test. Goals (not asserted): (1) p99 ≤ 10 ms;
(2) the rate sustained with POST p99 ≤ 50 ms and nothing lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from trainyard_cli import infra
from trainyard_cli.devstack import prepare_and_publish
from trainyard_cli.stack import EMBEDDED_FETCH_MAX_WAIT_MS, LocalStack, StackSettings
from trainyard_runtime.bus import ensure_topics
from trainyard_contract.events import ALLOCATIONS, METRICS, TERMINAL_STATES, WORKERS

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny.yaml"


# ----------------------------------------------------------------------------- figures (pure)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary_ms(seconds: list[float]) -> dict[str, float | int | None]:
    """p50/p99/max in milliseconds (None when nothing was measured)."""
    if not seconds:
        return {"samples": 0, "p50": None, "p99": None, "max": None}
    ms = [s * 1000.0 for s in seconds]
    return {"samples": len(ms), "p50": percentile(ms, 0.5), "p99": percentile(ms, 0.99), "max": max(ms)}


def ratios(figure: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    def over(key: str) -> float | None:
        a, b = figure.get(key), baseline.get(key)
        return None if a is None or not b else a / b
    return {"p50": over("p50"), "p99": over("p99")}


# ----------------------------------------------------------------------------- specs


def tiny_spec() -> dict[str, Any]:
    return dict(yaml.safe_load(TINY.read_text()))


def placeable_spec(name: str) -> dict[str, Any]:
    """One CPU device: placed at once on the idle cluster."""
    spec = tiny_spec()
    spec.update(name=name, resources={"gpuType": "cpu", "gpuCount": 1, "topology": "4-device-nodes"},
                parallelism={"data": 1, "tensor": 1, "pipeline": 1})
    spec["training"] = {**spec["training"], "microBatchSize": 8, "globalBatchSize": 8}
    return spec


def queued_spec(name: str, devices: int) -> dict[str, Any]:
    """More devices than the cluster has: accepted, then queued for capacity until cancelled."""
    spec = placeable_spec(name)
    spec.update(resources={"gpuType": "cpu", "gpuCount": devices, "topology": "4-device-nodes"},
                parallelism={"data": devices, "tensor": 1, "pipeline": 1})
    spec["training"] = {**spec["training"], "microBatchSize": 1, "globalBatchSize": devices}
    return spec


# ----------------------------------------------------------------------------- the stack


@contextmanager
def private_stack(nodes: int, devices: int) -> Iterator[LocalStack]:
    """A stack of its own (temporary state dir, free ports), tinycorpus@v1 published; down afterwards."""
    settings = StackSettings(
        state_dir=Path(tempfile.mkdtemp(prefix="trainyard-bench-control-plane-")) / ".trainyard",
        kafka_port=infra.free_port(), redis_port=infra.free_port(), api_port=infra.free_port(),
        nodes=nodes, devices_per_node=devices, ready_timeout_s=180, drain_timeout_s=0,
    )
    stack = LocalStack(settings)
    try:
        stack.up()
        prepare_and_publish(stack)
        yield stack
    finally:
        stack.down()
        shutil.rmtree(settings.root.parent, ignore_errors=True)


@dataclass
class EventWatch:
    """First arrival (monotonic) of GangAllocated and StepMetrics per jobId, from the moment it started."""

    consumer: AIOKafkaConsumer
    namespace: str
    allocated: dict[str, float] = field(default_factory=dict)
    first_step: dict[str, float] = field(default_factory=dict)
    ranks_started: dict[str, int] = field(default_factory=dict)
    ranks_exited: dict[str, int] = field(default_factory=dict)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, bootstrap: str, namespace: str) -> EventWatch:
        consumer = AIOKafkaConsumer(
            f"{namespace}{ALLOCATIONS}", f"{namespace}{METRICS}", f"{namespace}{WORKERS}", bootstrap_servers=bootstrap,
            group_id=f"bench-control-plane-{uuid.uuid4().hex[:8]}", auto_offset_reset="latest",
            enable_auto_commit=False,
            # the stack's own consumers' wait: the embedded broker answers a waiting fetch at the end of the wait,
            # so aiokafka's default 500 ms would measure the broker's polling, not the platform
            fetch_max_wait_ms=EMBEDDED_FETCH_MAX_WAIT_MS,
        )
        await consumer.start()
        while not consumer.assignment():  # the group's join happens in the background
            await asyncio.sleep(0.05)
        for tp in consumer.assignment():
            await consumer.position(tp)  # pins "latest" now, before anything is submitted
        watch = cls(consumer, namespace)
        watch._task = asyncio.create_task(watch._run())
        return watch

    async def _run(self) -> None:
        async for record in self.consumer:
            now = time.monotonic()
            try:
                event = json.loads(record.value or b"")
            except ValueError:
                continue
            kind, job_id = event.get("eventType"), event.get("jobId")
            if kind == "GangAllocated":
                self.allocated.setdefault(job_id, now)
            elif kind == "StepMetrics":
                self.first_step.setdefault(job_id, now)
            elif kind in ("WorkerStarted", "WorkerExited"):
                counts = self.ranks_started if kind == "WorkerStarted" else self.ranks_exited
                counts[job_id] = counts.get(job_id, 0) + 1
            else:
                continue
            self._arrived.set()

    async def wait(self, seen: dict[str, float], job_id: str, timeout_s: float) -> float | None:
        deadline = time.monotonic() + timeout_s
        while job_id not in seen:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), min(left, 1.0))
            except TimeoutError:
                pass
        return seen[job_id]

    async def ranks_gone(self, job_id: str, timeout_s: float = 30.0, quiet_s: float = 0.5) -> None:
        """Until every rank of the job that started has exited, and none started for ``quiet_s``."""
        deadline = time.monotonic() + timeout_s
        quiet_until = time.monotonic() + quiet_s
        last = self.ranks_started.get(job_id, 0)
        while time.monotonic() < deadline:
            started = self.ranks_started.get(job_id, 0)
            if started != last:
                last, quiet_until = started, time.monotonic() + quiet_s
            if self.ranks_exited.get(job_id, 0) >= started and time.monotonic() >= quiet_until:
                return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()


# ----------------------------------------------------------------------------- phases


async def broker_round_trip(bootstrap: str, namespace: str, samples: int) -> list[float]:
    """Produce one record, consume it back: send → arrival, ``samples`` times, one at a time."""
    topic = f"{namespace}bench.control-plane.rtt.{uuid.uuid4().hex[:8]}"
    await ensure_topics(bootstrap, partitions=1, topics=[topic])
    tp = TopicPartition(topic, 0)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=EMBEDDED_FETCH_MAX_WAIT_MS)
    await producer.start()
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        times: list[float] = []
        for i in range(samples + 10):  # the first 10 warm the connections up
            payload = f"{i}".encode()
            sent = time.monotonic()
            await producer.send_and_wait(topic, payload, partition=0)
            while (await consumer.getone()).value != payload:
                pass
            if i >= 10:
                times.append(time.monotonic() - sent)
        return times
    finally:
        await consumer.stop()
        await producer.stop()


async def wait_terminal(api: httpx.AsyncClient, job_id: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        state = (await api.get(f"/v1/training-jobs/{job_id}")).json().get("state")
        if state in TERMINAL_STATES or time.monotonic() > deadline:
            return str(state)
        await asyncio.sleep(0.05)


async def placement(api: httpx.AsyncClient, watch: EventWatch, submissions: int,
                    spec: Callable[[str], dict[str, Any]] | None = None) -> tuple[list[float], list[float], int]:
    """(1): for each of ``submissions`` sequential jobs (``spec(name)``, by default a 1-device CPU job), POST sent →
    GangAllocated and 202 → GangAllocated (negative when the allocation was announced before the 202 reached the
    client); jobs never placed."""
    spec = spec or placeable_spec
    times: list[float] = []
    after_202: list[float] = []
    missed = 0
    for i in range(submissions + 1):  # the first is a warm-up
        sent = time.monotonic()
        response = await api.post("/v1/training-jobs", json=spec(f"bench-place-{i}"))
        accepted = time.monotonic()
        response.raise_for_status()
        job_id = response.json()["jobId"]
        arrived = await watch.wait(watch.allocated, job_id, timeout_s=30.0)
        (await api.post(f"/v1/training-jobs/{job_id}/cancel")).raise_for_status()
        await wait_terminal(api, job_id)
        await watch.ranks_gone(job_id)  # an idle cluster: the cancelled job's rank is not still stopping
        if i == 0:
            continue
        if arrived is None:
            missed += 1
        else:
            times.append(arrived - sent)
            after_202.append(arrived - accepted)
    return times, after_202, missed


@dataclass
class Sustained:
    post: list[float] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


async def post_job(api: httpx.AsyncClient, spec: dict[str, Any], due: float, out: Sustained) -> None:
    """One POST of an open loop: its latency from ``due`` (its scheduled moment) when accepted, else counted as
    the error it got."""
    try:
        response = await api.post("/v1/training-jobs", json=spec)
    except httpx.HTTPError as exc:
        out.errors[type(exc).__name__] = out.errors.get(type(exc).__name__, 0) + 1
        return
    if response.status_code == 202:
        out.post.append(time.monotonic() - due)
        out.accepted.append(response.json()["jobId"])
    else:
        out.errors[str(response.status_code)] = out.errors.get(str(response.status_code), 0) + 1


async def sustained(api: httpx.AsyncClient, rate: float, seconds: float, devices: int) -> Sustained:
    """(2): an open loop of POSTs, each at its scheduled moment; latency from that moment."""
    out = Sustained()
    spec = queued_spec("bench-sustained", devices) if devices > 1 else placeable_spec("bench-sustained")

    async def one(due: float) -> None:
        await post_job(api, spec, due, out)

    start = time.monotonic()
    tasks = []
    for n in range(int(rate * seconds)):
        due = start + n / rate
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        tasks.append(asyncio.create_task(one(due)))
    await asyncio.gather(*tasks)
    return out


async def cancel_all(api: httpx.AsyncClient, job_ids: list[str], concurrency: int = 16) -> int:
    """Cancel each job; returns how many cancels were refused (other than by a job already terminal)."""
    gate = asyncio.Semaphore(concurrency)
    refused = 0

    async def one(job_id: str) -> None:
        nonlocal refused
        async with gate:
            response = await api.post(f"/v1/training-jobs/{job_id}/cancel")
            refused += response.status_code not in (202, 409)

    await asyncio.gather(*(one(j) for j in job_ids))
    return refused


async def listing(api: httpx.AsyncClient) -> dict[str, str]:
    """Every job of the tenant (GET /v1/training-jobs, all pages): jobId → state."""
    states: dict[str, str] = {}
    offset: int | None = 0
    while offset is not None:
        page = (await api.get("/v1/training-jobs", params={"limit": 500, "offset": offset})).json()
        states.update({j["jobId"]: j["state"] for j in page["jobs"]})
        offset = page.get("nextOffset")
    return states


async def settle(api: httpx.AsyncClient, job_ids: list[str], timeout_s: float) -> tuple[int, int, float]:
    """Wait until every job is listed and terminal; (listed, terminal, seconds waited)."""
    start = time.monotonic()
    while True:
        states = await listing(api)
        listed = [states[j] for j in job_ids if j in states]
        terminal = sum(s in TERMINAL_STATES for s in listed)
        if (len(listed) == terminal == len(job_ids)) or time.monotonic() - start > timeout_s:
            return len(listed), terminal, time.monotonic() - start
        await asyncio.sleep(1.0)


async def first_step(api: httpx.AsyncClient, watch: EventWatch, timeout_s: float) -> float | None:
    """(3): the example job, 202 → its first StepMetrics; cancelled afterwards."""
    response = await api.post("/v1/training-jobs", json=tiny_spec())
    accepted = time.monotonic()
    response.raise_for_status()
    job_id = response.json()["jobId"]
    arrived = await watch.wait(watch.first_step, job_id, timeout_s=timeout_s)
    await api.post(f"/v1/training-jobs/{job_id}/cancel")
    await wait_terminal(api, job_id)
    return None if arrived is None else arrived - accepted


# ----------------------------------------------------------------------------- the run


def _busy_ticks() -> tuple[int, int]:
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


async def host_quiet(limit_cores: float = 0.5, for_s: int = 8, timeout_s: float = 180.0) -> float:
    """Wait until the host's CPU has been quiet (under ``limit_cores`` busy) for ``for_s`` seconds in a row —
    longer than the agents wait before they refill their warm interpreters (5 s) — so that background work
    after a phase (each refill imports torch: seconds of CPU) is done before the next phase measures.
    Returns the seconds waited (at most ``timeout_s``)."""
    started = time.monotonic()
    cores = os.cpu_count() or 1
    quiet = 0
    while quiet < for_s and time.monotonic() - started < timeout_s:
        busy0, total0 = _busy_ticks()
        await asyncio.sleep(1.0)
        busy1, total1 = _busy_ticks()
        quiet = quiet + 1 if total1 > total0 and (busy1 - busy0) / (total1 - total0) * cores < limit_cores else 0
    return time.monotonic() - started


async def sustained_phase(api: httpx.AsyncClient, args: argparse.Namespace, devices: int,
                          baseline: dict[str, Any]) -> dict[str, Any]:
    """(2) as figures: the open loop, then every accepted job cancelled, terminal and listed."""
    started = time.monotonic()
    load = await sustained(api, args.rate, args.seconds, devices=devices)
    took = time.monotonic() - started
    before = await listing(api)
    states = {st: sum(before.get(j) == st for j in load.accepted) for st in set(before.values())}
    refused = await cancel_all(api, load.accepted)
    listed, terminal, waited = await settle(api, load.accepted, timeout_s=args.settle)
    post = summary_ms(load.post)
    return {
        "rate": args.rate, "seconds": args.seconds, "submitted": int(args.rate * args.seconds),
        "accepted": len(load.accepted), "errors": load.errors, "achieved_rate": len(load.accepted) / took,
        "post_ms": {**post, "ratio_to_broker": ratios(post, baseline)},
        "states_before_cancel": {k: v for k, v in states.items() if v},
        "cancels_refused": refused, "listed": listed, "terminal": terminal,
        "lost": len(load.accepted) - listed, "settle_s": waited,
    }


async def measure(stack: LocalStack, token: str, args: argparse.Namespace) -> dict[str, Any]:
    namespace, bootstrap = stack.s.topic_namespace, stack.kafka_bootstrap
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731 - a one-line printer
    say(f"baseline: {args.samples} broker round trips")
    baseline = summary_ms(await broker_round_trip(bootstrap, namespace, args.samples))
    watch = await EventWatch.start(bootstrap, namespace)
    # idle connections are dropped by the client before uvicorn's 5 s keep-alive ends, so a request never goes out
    # on a connection the server is closing (RemoteProtocolError: disconnected without a response)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200, keepalive_expiry=2.0)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=stack.s.api_url, headers=headers, timeout=60.0, limits=limits) as api:
        try:
            say(f"(1) {args.submissions} sequential submissions: POST sent → GangAllocated")
            await host_quiet(for_s=args.quiet_for)
            phase = time.monotonic()
            placed, after_202, missed = await placement(api, watch, args.submissions)
            walls = {"placement": time.monotonic() - phase}
            say(f"(2) {args.rate:g}/s for {args.seconds:g} s, open loop; then every job cancelled")
            await host_quiet(for_s=args.quiet_for)
            phase = time.monotonic()
            # twice the cluster: never placed (--placeable: one device, placed as devices free up, ranks run)
            devices = 1 if args.placeable else stack.s.nodes * stack.s.devices_per_node * 2
            load = await sustained_phase(api, args, devices, baseline)
            walls["sustained"] = time.monotonic() - phase
            say("(3) examples/tiny.yaml: 202 → first StepMetrics")
            await host_quiet(for_s=args.quiet_for)
            phase = time.monotonic()
            step = await first_step(api, watch, timeout_s=args.step_timeout)
            walls["first_step"] = time.monotonic() - phase
        finally:
            await watch.stop()
    allocated = summary_ms(placed)
    return {
        "broker_round_trip_ms": baseline,
        "gang_allocated_ms": {**allocated, "not_placed": missed, "ratio_to_broker": ratios(allocated, baseline),
                              "from": "the POST sent (its own round trip included)",
                              "after_202": summary_ms(after_202),
                              "before_202": sum(1 for t in after_202 if t < 0)},
        "sustained": load,
        "first_step_ms": {
            "value": None if step is None else step * 1000.0,
            "ratio_to_broker": None if step is None or not baseline["p50"] else step * 1000.0 / baseline["p50"],
        },
        "phase_wall_s": walls,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }


def fmt(value: float | None, unit: str = "ms") -> str:
    return "—" if value is None else f"{value:,.2f} {unit}" if unit else f"{value:,.1f}×"


def report(r: dict[str, Any]) -> None:
    b, g, s, f = r["broker_round_trip_ms"], r["gang_allocated_ms"], r["sustained"], r["first_step_ms"]
    p = s["post_ms"]
    print("\ncontrol plane on the local stack, ratios against the broker round trip measured here")
    print(f"{'figure':<44}{'p50':>13}{'p99':>13}{'p50 ratio':>12}{'p99 ratio':>12}")
    print(f"{'broker produce → consume round trip':<44}{fmt(b['p50']):>13}{fmt(b['p99']):>13}"
          f"{'1.0×':>12}{'1.0×':>12}")
    print(f"{'(1) POST sent → GangAllocated, idle cluster':<44}{fmt(g['p50']):>13}{fmt(g['p99']):>13}"
          f"{fmt(g['ratio_to_broker']['p50'], ''):>12}{fmt(g['ratio_to_broker']['p99'], ''):>12}")
    print(f"{'(2) POST at the offered rate':<44}{fmt(p['p50']):>13}{fmt(p['p99']):>13}"
          f"{fmt(p['ratio_to_broker']['p50'], ''):>12}{fmt(p['ratio_to_broker']['p99'], ''):>12}")
    print(f"{'(3) 202 → first StepMetrics (tiny.yaml)':<44}{fmt(f['value']):>13}{'':>13}"
          f"{fmt(f['ratio_to_broker'], ''):>12}")
    a = g["after_202"]
    print(f"(1) {g['samples']} submissions ({g['not_placed']} not placed within 30 s); goal p99 ≤ 10 ms from the 202. "
          f"Measured from the 202's arrival: p50 {fmt(a['p50'])}, p99 {fmt(a['p99'])}; {g['before_202']} of them were "
          "announced before the 202 reached the client (negative)")
    print(f"(2) offered {s['rate']:g}/s for {s['seconds']:g} s: {s['submitted']} sent, {s['accepted']} accepted "
          f"({s['achieved_rate']:.1f}/s), errors {s['errors'] or 'none'}; states before cancelling "
          f"{s['states_before_cancel']}")
    print(f"    after cancelling: {s['listed']} listed, {s['terminal']} terminal, lost {s['lost']} "
          f"(settled in {s['settle_s']:.1f} s); goal POST p99 ≤ 50 ms, 0 lost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--submissions", type=int, default=100, help="(1) sequential submissions")
    parser.add_argument("--rate", type=float, default=50.0, help="(2) submissions per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="(2) for how long")
    parser.add_argument("--samples", type=int, default=200, help="broker round trips for the baseline")
    parser.add_argument("--settle", type=float, default=300.0, help="(2) how long to wait for terminal + listed")
    parser.add_argument("--step-timeout", type=float, default=300.0, help="(3) how long to wait for the first step")
    parser.add_argument("--placeable", action="store_true",
                        help="(2) with 1-device jobs that are placed as devices free up (their ranks run on "
                             "this machine) instead of jobs that stay queued")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (20 round trips, 3 submissions, a 4 s open loop): the smoke test's")
    parser.add_argument("--quiet-for", type=int, default=8,
                        help="seconds of a quiet host CPU to wait for before each phase (0: do not wait)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if args.quick:  # the smoke test runs beside other tests: the host is never quiet, and nothing is measured
        args.samples, args.submissions, args.seconds = min(args.samples, 20), min(args.submissions, 3), 4.0
        args.quiet_for = 0
    started = time.monotonic()
    with private_stack(nodes=2, devices=4) as stack:
        token = stack.token_file.read_text().strip()
        result = asyncio.run(measure(stack, token, args))
    result["wall_s"] = time.monotonic() - started
    report(result)
    phases = ", ".join(f"{k} {v:.0f}s" for k, v in result["phase_wall_s"].items())
    print(f"({result['wall_s']:.0f}s, the stack's start included; {phases})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
