"""What confining a rank costs at its start: the same command (``python -I -c pass``) started bare, under the
sandbox as issue 30 found it (mount namespace, covers, binds, the job's uid), and under the whole containment
(plus the attempt's cgroup, a PID namespace under a pid 1, a private /dev/shm and the seccomp filter), interleaved
in one run. Needs root (as a sandboxed node agent does).

    python bench/sandbox_start/run.py [--runs 30]

Prints the median and p90 wall time of each and the ratios: the containment's added cost over the earlier sandbox
is what every rank now pays once at its start (a training rank then imports torch for seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainyard_node_agent import cgroups
from trainyard_node_agent import sandbox as sb

UID = 1_000_000_123


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, check=False)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{command[:3]}… failed ({done.returncode}): {done.stderr.decode()[-400:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="starts of each variant (interleaved)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the sandbox enters namespaces and becomes the job's user")
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-sandbox-") as tmp:
        root = Path(tmp)
        for d in ("art/jobs/j/checkpoints", "art/jobs/j/attempt/scratch", "shm"):
            (root / d).mkdir(parents=True)
        os.chown(root / "shm", UID, UID)
        view = sb.RankView(attempt_dir=root / "art/jobs/j/attempt", checkpoints=root / "art/jobs/j/checkpoints",
                           scratch=root / "art/jobs/j/attempt/scratch", runtime=sb.runtime_paths())
        hidden = (root / "art", *sb.host_hidden())
        earlier = dataclasses.replace(sb.plan_rank(view, uid=UID, gid=UID, hidden=hidden),
                                      pid_namespace=False, seccomp=False)
        layout, own = cgroups.host_layout()
        cgroup = cgroups.plan(layout, own, "bench.a1", cgroups.Limits(pids=4096), root="trainyard-bench")
        cgroups.create(cgroup)
        whole = dataclasses.replace(sb.plan_rank(view, uid=UID, gid=UID, hidden=hidden, anchors=(root / "art",)),
                                    cgroup_procs=tuple(str(p) for p in cgroup.procs), shm=str(root / "shm"))
        command = [sys.executable, "-I", "-c", "pass"]
        variants = {"bare": command, "sandbox (before)": sb.wrap(command, earlier),
                    "contained (now)": sb.wrap(command, whole)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        try:
            for _ in range(args.runs):
                for name, argv in variants.items():
                    times[name].append(_timed(argv))
        finally:
            cgroups.kill(cgroup)
            cgroups.remove(cgroup)
    med = {n: statistics.median(t) for n, t in times.items()}
    p90 = {n: sorted(t)[int(0.9 * (len(t) - 1))] for n, t in times.items()}
    for name in variants:
        print(f"{name:18s} median {med[name] * 1e3:7.1f} ms   p90 {p90[name] * 1e3:7.1f} ms")
    print(f"contained / sandbox (before): {med['contained (now)'] / med['sandbox (before)']:.2f}   "
          f"added per rank start: {(med['contained (now)'] - med['sandbox (before)']) * 1e3:.1f} ms")
    print(json.dumps({"runs": args.runs, "median_s": med, "p90_s": p90}))


if __name__ == "__main__":
    main()
