"""What starting the ``trainyard`` command costs (a benchmark: it prints figures, never fails).

    python bench/cli_start/run.py [--runs 5] [--before-src DIR] [--json results.json]

Each command is run ``--runs`` times in turn (round robin, so a busy moment on the host spreads over all of
them), as a user's shell runs it: a fresh ``trainyard`` process. Figures are medians and bests (the least of
the runs: interference from other work on the host only ever slows a run down) of wall seconds and of CPU
seconds (user + system, from the child's rusage). In the same run:

    baseline         ``python -c pass``: the interpreter's own start
    --help           ``trainyard --help``
    jobs list --help ``trainyard jobs list --help``
    jobs list        ``trainyard jobs list`` against a stand-in API on 127.0.0.1 (a thread here answering the
                     one GET with a canned page of 20 jobs): start, one request, a table
    plan memory      ``trainyard plan memory --params 7e9`` (local arithmetic; imports the planner)

Each is also given as a ratio to the baseline and as its excess over it (command − interpreter).
``--before-src DIR`` runs every command a second time with ``DIR`` (an older checkout's ``libs/cli/src``,
e.g. from ``git archive <commit> libs/cli | tar -x -C /tmp/old``) first on ``PYTHONPATH``: before and after,
side by side, in one run. Goal (not asserted): ``--help`` and simple commands under 0.5 s of wall time;
``tests/unit/trainyard_cli/test_cli_start.py`` asserts what they do not import.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

TOKEN = "bench-token"


def job_page(n: int = 20) -> bytes:
    """A page of ``n`` jobs as ``GET /v1/training-jobs`` answers it."""
    from trainyard_contract.wire import JobPage, JobSummary

    now = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    jobs = [JobSummary(job_id=f"job-{i:012x}", name=f"sweep-lr-{i}", state=("running", "queued", "failed")[i % 3],
                       spec_hash="sha256:" + "0" * 64, model="gpt-1b@v1", dataset="tinycorpus@v1", gpu_count=8,
                       attempts=1, global_step=100 * i, max_steps=10_000, last_loss=2.5, created_at=now, updated_at=now,
                       queued_reason="waiting for 8 x h100-80gb" if i % 3 == 1 else None,
                       reason="rank 3 exited 1: CUDA out of memory" if i % 3 == 2 else None)
            for i in range(n)]
    return JobPage(jobs=jobs, next_offset=None).model_dump_json(by_alias=True).encode()


class StandIn(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before-src", type=Path, default=None, help="an older libs/cli/src to compare with")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()

    StandIn.body = job_page()
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    python = sys.executable
    entry = [python, "-c", "import sys; from trainyard_cli.main import app; sys.exit(app(prog_name='trainyard'))"]
    commands = {
        "baseline": [python, "-c", "pass"],
        "--help": [*entry, "--help"],
        "jobs list --help": [*entry, "jobs", "list", "--help"],
        "jobs list": [*entry, "--api-url", url, "--token", TOKEN, "jobs", "list"],
        "plan memory": [*entry, "plan", "memory", "--params", "7e9"],
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env["COLUMNS"] = "80"
    variants = {"after": env}
    if args.before_src is not None:
        path = f"{args.before_src.resolve()}{os.pathsep}{env.get('PYTHONPATH', '')}"
        variants["before"] = {**env, "PYTHONPATH": path}
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {v: {c: [] for c in commands} for v in variants}
    try:
        for _ in range(args.runs):
            for variant, variant_env in variants.items():
                for name, argv in commands.items():
                    samples[variant][name].append(run_once(argv, variant_env))
    finally:
        server.shutdown()

    results: dict[str, Any] = {"runs": args.runs, "python": sys.version.split()[0], "variants": {}}
    for variant, by_command in samples.items():
        base_wall = statistics.median(w for w, _ in by_command["baseline"])
        base_cpu = statistics.median(c for _, c in by_command["baseline"])
        figures = {}
        for name, runs in by_command.items():
            wall = statistics.median(w for w, _ in runs)
            cpu = statistics.median(c for _, c in runs)
            figures[name] = {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                             "best_wall_s": round(min(w for w, _ in runs), 4),
                             "best_cpu_s": round(min(c for _, c in runs), 4),
                             "ratio_to_baseline": round(wall / base_wall, 1) if base_wall else None,
                             "excess_wall_s": round(wall - base_wall, 4), "excess_cpu_s": round(cpu - base_cpu, 4)}
        results["variants"][variant] = figures

    print(f"median of {args.runs} runs (best in brackets); wall s / CPU s (user+sys); ratio and excess of the median "
          "against `python -c pass`")
    for variant, figures in results["variants"].items():
        print(f"\n{variant}:")
        for name, f in figures.items():
            print(f"  {name:<18} {f['wall_s']:6.3f} s ({f['best_wall_s']:.3f})  cpu {f['cpu_s']:6.3f} s "
                  f"({f['best_cpu_s']:.3f})  x{f['ratio_to_baseline']:<6} +{f['excess_wall_s']:.3f} s")
    if "before" in results["variants"]:
        print("\nafter / before (wall):")
        for name in commands:
            if name != "baseline":
                before, after = results["variants"]["before"][name], results["variants"]["after"][name]
                print(f"  {name:<18} {after['wall_s'] / before['wall_s']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
