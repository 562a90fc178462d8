"""The Lab's calls, timed: what a control change costs before the page has its new numbers.

    python bench/lab/run.py [--repeat 200] [--json results.json]

A benchmark, not a test: it prints p50 / p99 per call and never fails on them. The issue's budget
is a Lab control change to updated numbers in <= 50 ms. Each sample is what ``POST /v1/lab/…``
does after authentication: validate the JSON body into the request model, run the sweep
(:mod:`trainyard_api.lab` over :mod:`trainyard_planner.lab`) and serialise the camelCase answer;
the token lookup (one Redis GET) and the HTTP framing come on top, both well under a millisecond
on a local stack.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from trainyard_api.lab import (
    LabCheckpointRequest,
    LabMemoryRequest,
    LabScalingRequest,
    lab_checkpoint,
    lab_memory,
    lab_scaling,
)

CASES: list[tuple[str, Callable[[dict[str, Any]], str], dict[str, Any]]] = [
    ("memory 7B fsdp x8", lambda b: lab_memory(LabMemoryRequest.model_validate(b)).model_dump_json(by_alias=True),
     {"model": {"parameters": 7e9}, "devices": 8, "sharding": "fsdp", "device": "h100-80gb"}),
    ("memory gpt-1b ddp x64 selective", lambda b: lab_memory(LabMemoryRequest.model_validate(b)).model_dump_json(
        by_alias=True), {"model": "gpt-1b@v1", "devices": 64, "recompute": "selective", "microBatch": 4}),
    ("memory 405B wide curve", lambda b: lab_memory(LabMemoryRequest.model_validate(b)).model_dump_json(
        by_alias=True), {"model": {"parameters": 405e9, "seqLen": 8192}, "devices": 1024, "sharding": "fsdp",
                         "curveFrom": 1e6, "curveTo": 1e15}),
    ("scaling gpt-1b 1..64 nodes", lambda b: lab_scaling(LabScalingRequest.model_validate(b)).model_dump_json(
        by_alias=True), {"model": "gpt-1b@v1", "nodes": 64, "interconnectGBps": 5, "globalBatch": 512}),
    ("scaling 70B tp8 64 listed nodes", lambda b: lab_scaling(LabScalingRequest.model_validate(b)).model_dump_json(
        by_alias=True), {"model": {"parameters": 70e9}, "nodes": list(range(1, 65)), "tensor": 8,
                         "sharding": "fsdp", "globalBatch": 1024}),
    ("checkpoint 61 points", lambda b: lab_checkpoint(LabCheckpointRequest.model_validate(b)).model_dump_json(
        by_alias=True), {"mtbfHours": 3.1, "writeSeconds": 60, "restartSeconds": 600, "stepSeconds": 5}),
    ("checkpoint 401 points", lambda b: lab_checkpoint(LabCheckpointRequest.model_validate(b)).model_dump_json(
        by_alias=True), {"mtbfHours": 3.1, "writeSeconds": 60, "points": 401, "span": 100}),
]


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    results = []
    print(f"{'call':36} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'bytes':>8}")
    for name, call, body in CASES:
        size = len(call(body))  # warm-up
        samples = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            call(body)
            samples.append((time.perf_counter() - start) * 1e3)
        row = {"call": name, "p50Ms": statistics.median(samples), "p99Ms": percentile(samples, 0.99),
               "maxMs": max(samples), "responseBytes": size, "repeat": args.repeat}
        results.append(row)
        print(f"{name:36} {row['p50Ms']:8.2f} {row['p99Ms']:8.2f} {row['maxMs']:8.2f} {size:8d}")
    worst = max(r["p99Ms"] for r in results)
    print(f"worst p99 {worst:.2f} ms against the issue's 50 ms per Lab control change")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"results": results, "worstP99Ms": worst, "budgetMs": 50}, f, indent=2)


if __name__ == "__main__":
    main()
