"""What confirming acknowledged writes with a replica costs (a benchmark: it prints figures, never fails).

    python bench/redis_confirm/run.py [--samples 400] [--json results.json]

A Redis primary, its replica and a Sentinel on this host (trainyard_cli.redisha, as ``TRAINYARD_REDIS_HA=1
make up`` starts them, AOF with fsync on every write), reached through a ``redis+sentinel://`` client. In the
same run, each ``--samples`` times in turn (round robin, so a busy moment spreads over all of them):

    baseline        one SET through the Sentinel client: a round trip to the primary
    MULTI           a job submission's MULTI as the API writes it (the record SET NX, the change stream
                    entry, the incoming set, two indexes and the outbox entry), answered by the primary alone
                    (``?epoch_acks=0``: how every write but the epochs was acknowledged before)
    MULTI+confirm   the same MULTI through the outbox's execute: its confirmation token, then DEL + WAIT for the
                    replica (the default behind Sentinel now)
    POST            ``POST /v1/training-jobs`` through the API's ASGI app (validation, auth, the MULTI, the
                    response; no socket): primary alone vs confirmed

Figures are p50/p99 in milliseconds, and each confirmed figure as a ratio to its unconfirmed twin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from trainyard_api import ApiSettings
from trainyard_api.app import ApiContext, create_app
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_cli import infra, redisha
from trainyard_contract import events as ev
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import DatasetRecord
from trainyard_contract.spec import TrainingSpec
from trainyard_runtime.store import Keys, StateStore, connect_redis

TOKEN = "bench-token"


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


SPEC = TrainingSpec.model_validate(EXAMPLE_SPEC)


async def submission_multi(redis: Any, outbox: Outbox, n: int) -> None:
    """The API's submission MULTI; the event it stages is the JobSubmitted of the record it writes (the scheduler
    acts on no job event the API did not write the record of)."""
    job_id = f"job-bench{n:08d}"
    async with redis.pipeline(transaction=True) as pipe:
        pipe.set(Keys.job(job_id), "{}", nx=True)
        pipe.xadd("ty:bench:changes", {"kind": "job", "id": job_id}, maxlen=10_000, approximate=True)
        pipe.sadd("ty:bench:incoming", job_id)
        pipe.zadd("ty:bench:jobs", {job_id: n})
        pipe.zadd("ty:bench:tenant-jobs", {job_id: n})
        outbox.stage(pipe, ev.JobSubmitted(job_id=job_id, tenant="t", spec=SPEC, spec_hash=SPEC.spec_hash()))
        await pipe.execute()


async def api_client(url: str, root: Path) -> tuple[httpx.AsyncClient, Any]:
    redis = connect_redis(url)
    store = StateStore(redis)
    await store.add_token(TOKEN, "tenant-a", "bench")
    await store.put_dataset(DatasetRecord(name="tinycorpus", version="v1", manifest_uri="file:///x/manifest.json",
                                          sha256="ab" * 32, tokenizer="bpe-1024@v1", num_tokens=123_456))
    app = create_app(ApiContext(ApiSettings(redis_url=url, artifact_root=root), store, Outbox(redis, "api")))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api",
                               headers={"Authorization": f"Bearer {TOKEN}"})
    return client, redis


async def run(samples: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ty-bench-confirm-") as tmp:
        root = Path(tmp)
        ha = redisha.RedisHA(root, root / "logs", (infra.free_port(), infra.free_port()), (infra.free_port(),))
        ha.start(timings=redisha.FAST, quorum=1)
        try:
            alone, confirmed = connect_redis(ha.url() + "?epoch_acks=0"), connect_redis(ha.url())
            outboxes = {"alone": Outbox(alone, "bench-a"), "confirmed": Outbox(confirmed, "bench-c")}
            posts = {"alone": await api_client(ha.url() + "?epoch_acks=0", root / "a"),
                     "confirmed": await api_client(ha.url(), root / "c")}
            times: dict[str, list[float]] = {k: [] for k in
                                             ("baseline", "multi", "multi+confirm", "post", "post+confirm")}
            for _ in range(20):  # warm-up, and the replica in sync
                await alone.set("ty:bench:x", "1")
            for n in range(samples):
                for name, op in (
                    ("baseline", lambda: alone.set("ty:bench:x", str(n))),  # noqa: B023 - run in this iteration
                    ("multi", lambda: submission_multi(alone, outboxes["alone"], 2 * n)),  # noqa: B023 - as above
                    ("multi+confirm", lambda: submission_multi(confirmed, outboxes["confirmed"], 2 * n + 1)),  # noqa: B023 - as above
                    ("post", lambda: posts["alone"][0].post("/v1/training-jobs", json=EXAMPLE_SPEC)),
                    ("post+confirm", lambda: posts["confirmed"][0].post("/v1/training-jobs", json=EXAMPLE_SPEC)),
                ):
                    t0 = time.perf_counter()
                    result = await op()
                    times[name].append(time.perf_counter() - t0)
                    if isinstance(result, httpx.Response) and result.status_code != 202:
                        raise SystemExit(f"{name}: {result.status_code} {result.text}")
            for client, redis in posts.values():
                await client.aclose()
                await redis.aclose()
            await alone.aclose()
            await confirmed.aclose()
        finally:
            ha.stop()
    figures = {k: {"p50_ms": round(pct(v, 0.5), 3), "p99_ms": round(pct(v, 0.99), 3),
                   "mean_ms": round(statistics.fmean(v) * 1000, 3)} for k, v in times.items()}
    for confirmed_name, alone_name in (("multi+confirm", "multi"), ("post+confirm", "post")):
        with_confirm, without = figures[confirmed_name], figures[alone_name]
        with_confirm["ratio_p50"] = round(with_confirm["p50_ms"] / without["p50_ms"], 2)
        with_confirm["ratio_p99"] = round(with_confirm["p99_ms"] / without["p99_ms"], 2)
    return {"samples": samples, "figures": figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args.samples))
    print(f"{'':16}{'p50 ms':>10}{'p99 ms':>10}{'ratio p50':>11}{'ratio p99':>11}")
    for name, f in results["figures"].items():
        print(f"{name:16}{f['p50_ms']:>10.3f}{f['p99_ms']:>10.3f}"
              f"{f.get('ratio_p50', ''):>11}{f.get('ratio_p99', ''):>11}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
