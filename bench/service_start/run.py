"""How long a service takes to start consuming, first start or restart (a benchmark: it prints figures, never fails).

    python bench/service_start/run.py [--rounds 3] [--session-timeout-ms 6000] [--json results.json]

A private broker (tansu, memory storage) and redis-server on free ports. Each service of the control plane
(api, scheduler, checkpoint-coordinator, registry, telemetry) is built as its ``__main__`` builds it, with the
settings' defaults, and its ``ServiceRuntime.start()`` is timed: Redis, topics, the bus (every consumer group
joined and assigned), the loops. Two ways of starting the bus, in turn in the same run:

    baseline     faststream's own ``broker.start()``: the subscribers one after another
    concurrent   ``trainyard_runtime.bus.start_concurrently``: the subscribers side by side

A consumer's start waits for its group's first assignment: about half the session timeout on the embedded
broker, and on Apache Kafka a new group's ``group.initial.rebalance.delay.ms`` (3 s by default). Each round
times a first start (new groups: a new topic namespace and group prefix) and a restart (the same groups, after
the first process closed). Figures are medians over ``--rounds``; the ratio is concurrent / baseline.

Measured here (2 cores, 3 rounds, session timeout 6000 ms; concurrent against baseline): a first start takes
3.1 s whatever the number of groups, against 6.1 s (2 groups) to 15.1 s (the scheduler's 5). A restart at once
after a close mostly waits for the closed members' sessions to expire (the embedded broker keeps them, as Kafka
does after a kill -9): 11.2 s against 14.2 s (2 groups) to 23.2 s (5). The API's restart is the exception,
9.1 s against 11.2 s: two of its three groups (the live event streams') are new in every process, and only its
triggers group outlives it. One after another, that group's join began behind a new group's (3 s), so the
closed member's session ran out while the others joined; side by side, the restart waits that expiry out alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard_cli import infra
from trainyard_runtime import bus as bus_module
from trainyard_runtime.service import ServiceRuntime

SERVICES = ("api", "scheduler", "checkpoint-coordinator", "registry", "telemetry")


def build(service: str, common: dict[str, Any], tmp: Path) -> tuple[ServiceRuntime, Callable[[], Any]]:
    """The service's runtime, wired by the builder its ``__main__`` serves (not started), and what closes it."""
    if service == "api":
        from trainyard_api.server import ApiServer
        from trainyard_api.settings import ApiSettings
        server = ApiServer(ApiSettings(**common, api_port=0, api_bootstrap_admin_token_file=tmp / "admin-token"))
        return server.runtime, server.aclose
    if service == "scheduler":
        from trainyard_scheduler.scheduler import build_service as scheduler
        from trainyard_scheduler.settings import SchedulerSettings
        runtime = scheduler(SchedulerSettings(**common))
        return runtime, runtime.aclose
    if service == "checkpoint-coordinator":
        from trainyard_checkpoint_coordinator.coordinator import build_service as coordinator
        from trainyard_checkpoint_coordinator.settings import CoordinatorSettings
        runtime = coordinator(CoordinatorSettings(**common))
        return runtime, runtime.aclose
    if service == "registry":
        from trainyard_registry.registry import build_service as registry
        from trainyard_registry.settings import RegistrySettings
        runtime = registry(RegistrySettings(**common))
        return runtime, runtime.aclose
    from trainyard_telemetry.service import TelemetryService
    from trainyard_telemetry.settings import TelemetrySettings
    telemetry = TelemetryService(TelemetrySettings(**common))
    return telemetry.runtime, telemetry.runtime.aclose


async def timed_start(service: str, common: dict[str, Any], tmp: Path) -> tuple[float, int]:
    """Seconds from ``start()`` to started, and the number of consumer groups the service joined."""
    runtime, close = build(service, common, tmp)
    began = time.perf_counter()
    await runtime.start()
    took = time.perf_counter() - began
    groups = len(runtime.bus.broker.subscribers)
    await close()
    return took, groups


async def measure(bootstrap: str, redis_url: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    concurrent = bus_module.start_concurrently

    async def baseline(broker: Any) -> None:
        await broker.start()

    ways = {"baseline": baseline, "concurrent": concurrent}
    samples: dict[tuple[str, str, str], list[float]] = {}
    groups: dict[str, int] = {}
    for round_ in range(args.rounds):
        for service in SERVICES:
            for way, start in ways.items():  # in turn: a busy moment on the host spreads over both
                bus_module.start_concurrently = start  # Bus.start looks it up per call
                unique = uuid.uuid4().hex[:8]
                common = {"kafka_bootstrap": bootstrap, "redis_url": redis_url, "topic_namespace": f"b{unique}.",
                          "group_prefix": f"g{unique}", "artifact_root": tmp / "artifacts",
                          "consumer_session_timeout_ms": args.session_timeout_ms, "instance_id": f"bench-{unique}"}
                for phase in ("first start", "restart"):
                    took, groups[service] = await timed_start(service, common, tmp)
                    samples.setdefault((service, way, phase), []).append(took)
                print(f"  round {round_ + 1}/{args.rounds} {service:<23} {way:<10} "
                      f"{samples[(service, way, 'first start')][-1]:5.2f} s, restart "
                      f"{samples[(service, way, 'restart')][-1]:5.2f} s", flush=True)
    bus_module.start_concurrently = concurrent
    rows = []
    for service in SERVICES:
        for phase in ("first start", "restart"):
            base = statistics.median(samples[(service, "baseline", phase)])
            conc = statistics.median(samples[(service, "concurrent", phase)])
            rows.append({"service": service, "groups": groups[service], "phase": phase,
                         "baselineS": round(base, 3), "concurrentS": round(conc, 3), "ratio": round(conc / base, 3)})
    return {"rounds": args.rounds, "sessionTimeoutMs": args.session_timeout_ms, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="starts of each service each way (default 3)")
    parser.add_argument("--session-timeout-ms", type=int, default=6000,
                        help="the consumers' session timeout (default 6000, the settings' default)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # quiet: every consumer's join, every start's and close's lines
    for name in ("faststream", "aiokafka", "trainyard", "trainyard_runtime", "opentelemetry"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="ty-bench-start-") as tmp_dir:
        tmp = Path(tmp_dir)
        broker_port = infra.free_ports(2)
        redis_port = broker_port + 1
        broker = infra.start_broker(broker_port, tmp / "broker.log")
        redis = infra.start_redis(redis_port, tmp / "redis", tmp / "redis.log")
        try:
            result = asyncio.run(measure(broker.address, redis.address, args, tmp))
        finally:
            broker.stop()
            redis.stop()
    print(f"\nstart → consuming, median of {args.rounds} (session timeout {args.session_timeout_ms} ms)")
    print(f"{'service':<23} {'groups':>6} {'phase':<12} {'baseline':>9} {'concurrent':>11} {'ratio':>6}")
    for r in result["rows"]:
        print(f"{r['service']:<23} {r['groups']:>6} {r['phase']:<12} {r['baselineS']:>8.2f}s "
              f"{r['concurrentS']:>10.2f}s {r['ratio']:>6.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
