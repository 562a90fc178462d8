"""What the trainyard trainer costs over a minimal hand-written torch loop (printed ratios, not a test).

The same model (trainyard's GPT), the same dataset files, the same batch (micro x ranks x
accumulation = global), the same optimizer, schedule and gradient clipping, trained

- by a minimal loop (:func:`baseline_rank`): random windows read straight from the dataset's
  memory-mapped shards, DDP with ``no_sync`` micro steps, AdamW, ``clip_grad_norm_``, LambdaLR;
- by ``python -m trainyard_trainer`` ranks, launched with the node agent's environment contract:
  the global sampler, shard verification, the run record, StepMetrics appended to the spool
  every step, the loss all-reduce, timing, an async checkpoint at the end;

on 1 rank and on 2-rank DDP (gloo, CPU), in the same run, alternating, twice: with one
intra-op thread per rank (the old comparison), and with each rank's share of the machine's
cores (what the node agent gives a rank: usable cores // ranks, ``TRAINYARD_CPU_THREADS``),
the hand-written loop calling ``torch.set_num_threads`` with the same count. A world whose
share is one thread is measured once. Throughput is steady-state tokens/s: tokens per median interval between step ends
(the first WARMUP steps and the final step, which waits for its checkpoint, are left out); the figure per configuration
is the best of REPEATS runs (as timeit does: interference only ever slows a run down). Target: trainer / baseline >=
0.97.

    python bench/trainer_overhead/run.py [--steps 40] [--repeats 2] [--device cpu|cuda] [--threads 1,share]
                                         [--json PATH]

``--device cuda`` runs the same comparison on GPUs (nccl, bf16 autocast): see bench/gpu/run.sh.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

WARMUP = 4
EXTRA_ENV: dict[str, str | None] = {}  # more rank settings for the trainer (None: unset), e.g. from bench/gpu/mfu.py
CPU_MODEL = {"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 128, "maxSeqLen": 64}
CPU_BATCH = {"sequenceLength": 64, "microBatchSize": 8, "globalBatchSize": 32}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_wire(args: argparse.Namespace, world: int) -> dict:
    return {
        "specVersion": "v1", "modelConfig": args.model_json, "dataset": "tinycorpus@v1", "codeRevision": "bench",
        "resources": {"gpuType": args.device, "gpuCount": world}, "parallelism": {"data": world},
        "checkpointPolicy": {"everySteps": 1_000_000},
        "training": {**args.batch, "seed": 1, "learningRate": 1e-3, "maxSteps": args.steps,
                     "lrSchedule": {"name": "cosine", "warmupSteps": 2}, "deterministic": False},
    }


def rank_env(rank: int, world: int, port: int, threads: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "OTEL_"))}
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OTEL_TRACES_EXPORTER": "none",
                "OMP_NUM_THREADS": str(threads), **extra})
    return env


def thread_counts(choice: str, world: int) -> list[int]:
    """The intra-op thread counts to compare for ``world`` ranks: ``1`` and/or ``share`` (the node
    agent's rule, ``cpu_thread_share``), each once."""
    from trainyard_node_agent.admission import cpu_thread_share

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    counts = [1 if c == "1" else cpu_thread_share(cores, world) if c == "share" else int(c) for c in choice.split(",")]
    return list(dict.fromkeys(counts))


# ----------------------------------------------------------------------------- the trainyard trainer


def job_id(world: int, run: int, threads: int = 1) -> str:
    """The job a :func:`run_trainer` run writes its artifacts under."""
    return f"bench-{world}-{threads}-{run}"


def run_trainer(args: argparse.Namespace, root: Path, world: int, run: int, threads: int = 1) -> list[float]:
    from trainyard_contract.events import GangAllocated, NodeAssignment, RankAssignment
    from trainyard_contract.spec import TrainingSpec
    from trainyard_contract.storage import ArtifactLayout, atomic_write_bytes

    spec = TrainingSpec.model_validate(spec_wire(args, world))
    layout, port, job = ArtifactLayout(root), free_port(), job_id(world, run, threads)
    allocation = GangAllocated(
        job_id=job, tenant="bench", attempt=1, allocation_id="a", epoch=1, world_size=world,
        master_addr="127.0.0.1", master_port=port, spec=spec, spec_hash=spec.spec_hash(),
        nodes=[NodeAssignment(node_id="n", host="localhost",
                              ranks=[RankAssignment(rank=r, local_rank=r, device_index=r) for r in range(world)])],
    )
    alloc_file = layout.attempt_dir("bench", job, 1) / "allocation.json"
    atomic_write_bytes(alloc_file, allocation.to_bytes())
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, threads, {
            "TRAINYARD_BACKEND": "nccl" if args.device == "cuda" else "gloo", "TRAINYARD_DEVICE_INDEX": str(rank),
            "TRAINYARD_JOB_ID": job, "TRAINYARD_TENANT": "bench", "TRAINYARD_ATTEMPT": "1", "TRAINYARD_EPOCH": "1",
            "TRAINYARD_ALLOCATION_ID": "a", "TRAINYARD_ARTIFACT_ROOT": str(root),
            "TRAINYARD_ALLOCATION_FILE": str(alloc_file),
            "TRAINYARD_EVENTS_FILE": str(layout.rank_events("bench", job, 1, rank)),
            "TRAINYARD_PEAK_FLOPS": "1e12", "TRAINYARD_LOG_LEVEL": "WARNING", "TRAINYARD_CPU_THREADS": str(threads),
        })
        env.update({k: v for k, v in EXTRA_ENV.items() if v is not None})
        for key in [k for k, v in EXTRA_ENV.items() if v is None]:
            env.pop(key, None)
        procs.append(subprocess.Popen([sys.executable, "-m", "trainyard_trainer"], env=env))
    if any(p.wait() for p in procs):
        raise SystemExit(f"trainer ranks failed: {[p.returncode for p in procs]}")
    events = [json.loads(line)["payload"] for line in layout.rank_events("bench", job, 1, 0).read_text().splitlines()]
    ends = [datetime.fromisoformat(e["occurredAt"].replace("Z", "+00:00")).timestamp()
            for e in events if e["eventType"] == "StepMetrics"]
    return ends


# ----------------------------------------------------------------------------- the minimal loop


def baseline_rank(args: argparse.Namespace) -> None:
    """One rank of the hand-written loop; prints the wall-clock time at the end of each step."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812 - torch's own spelling

    from trainyard_contract.catalog import ModelConfig
    from trainyard_trainer.model import build_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
    torch.manual_seed(1)
    config = ModelConfig.model_validate(args.model_json)
    model = build_model(config, seed=1, device=device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))
    shards = [np.memmap(p, dtype="<u2", mode="r") for p in sorted(Path(args.data).glob("shard-*.bin"))]
    seq, micro = args.batch["sequenceLength"], args.batch["microBatchSize"]
    accumulation = args.batch["globalBatchSize"] // (micro * world)
    rng = np.random.default_rng(rank)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    ends = []
    for _ in range(args.steps):
        for k in range(accumulation):
            rows = []
            for _ in range(micro):
                shard = shards[rng.integers(len(shards))]
                start = int(rng.integers((len(shard) - seq - 1) // seq)) * seq
                rows.append(np.asarray(shard[start:start + seq + 1], dtype=np.int64))
            batch = torch.from_numpy(np.stack(rows)).to(device, non_blocking=True)
            with ddp.no_sync() if k < accumulation - 1 else torch.enable_grad(), autocast:
                logits = ddp(batch[:, :-1])[0]
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
            (loss / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the host learns the loss every step, as any real loop does
        ends.append(time.time())
    dist.destroy_process_group()
    if rank == 0:
        print("ENDS " + json.dumps(ends), flush=True)


def run_baseline(args: argparse.Namespace, root: Path, world: int, threads: int) -> list[float]:
    port = free_port()
    data = root / "datasets" / "tinycorpus" / "v1"
    argv = [sys.executable, __file__, "--baseline-rank", "--steps", str(args.steps), "--device", args.device,
            "--data", str(data), "--model-json", json.dumps(args.model_json), "--batch-json", json.dumps(args.batch),
            "--rank-threads", str(threads)]
    procs = [subprocess.Popen(argv, env=rank_env(r, world, port, threads, {}), stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"baseline ranks failed: {[p.returncode for p in procs]}")
    line = next(line for line in outputs[0].splitlines() if line.startswith("ENDS "))
    return json.loads(line[5:])


def step_intervals(ends: list[float]) -> list[float]:
    """Step-end to step-end intervals, the first WARMUP steps and the last one (it waits for its
    checkpoint) left out."""
    window = ends[WARMUP - 1:-1]
    return [b - a for a, b in zip(window, window[1:], strict=False)]


def steady_tokens_per_second(ends: list[float], tokens_per_step: int) -> float:
    """Tokens per median step interval (step end to step end: everything a step costs, reporting included).

    The median keeps a neighbour's burst of CPU use on a shared machine from deciding the figure.
    """
    return tokens_per_step / statistics.median(step_intervals(ends))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--worlds", default="1,2", help="rank counts to compare, e.g. 1,2 or 1,8")
    parser.add_argument("--threads", default="1,share",
                        help="intra-op threads per rank to compare (CPU): 1, share (usable cores // ranks) or a figure")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    parser.add_argument("--model-json", type=json.loads, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch-json", type=json.loads, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--baseline-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-threads", dest="threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model_json = args.model_json or CPU_MODEL
    args.batch = args.batch_json or CPU_BATCH
    if args.baseline_rank:
        baseline_rank(args)
        return
    choice = args.threads

    from trainyard.data import STDLIB_SOURCES, prepare_dataset

    root = Path(tempfile.mkdtemp(prefix="overhead-bench-")) / "artifacts"
    try:
        prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:12])
        tokens = args.batch["globalBatchSize"] * args.batch["sequenceLength"]
        configs = [(int(w), t) for w in args.worlds.split(",")
                   for t in (thread_counts(choice, int(w)) if args.device == "cpu" else [1])]
        results: dict[tuple[int, int], dict[str, list[list[float]]]] = {}
        for run in range(args.repeats):
            for world, threads in configs:
                mine = results.setdefault((world, threads), {"baseline": [], "trainer": []})
                order = ("baseline", "trainer") if run % 2 == 0 else ("trainer", "baseline")
                for who in order:
                    ends = (run_baseline(args, root, world, threads) if who == "baseline"
                            else run_trainer(args, root, world, run, threads))
                    mine[who].append(ends)
        print(f"model {args.model_json}, batch {args.batch}, {args.steps} steps, {args.device}; steady-state tokens/s "
              f"(best of {args.repeats}); step p50/p99 of the best run")
        figures = []
        for (world, threads), mine in results.items():
            rates = {who: [steady_tokens_per_second(e, tokens) for e in runs] for who, runs in mine.items()}
            best = {who: runs[max(range(len(runs)), key=rates[who].__getitem__)] for who, runs in mine.items()}
            steps = {who: step_intervals(e) for who, e in best.items()}
            base, ours = max(rates["baseline"]), max(rates["trainer"])
            label = f"{world} rank(s) x {threads} thread(s)"
            print(f"  {label}: hand-written loop {base:10.1f} tok/s   trainyard trainer {ours:10.1f} tok/s   "
                  f"runs {[round(v) for v in rates['baseline']]} / {[round(v) for v in rates['trainer']]}")
            print(f"    step p50/p99 ms: loop {1e3 * percentile(steps['baseline'], .5):.1f}/"
                  f"{1e3 * percentile(steps['baseline'], .99):.1f}   "
                  f"trainer {1e3 * percentile(steps['trainer'], .5):.1f}/"
                  f"{1e3 * percentile(steps['trainer'], .99):.1f}")
            print(f"RATIO trainer/baseline tokens/s, {label} = {ours / base:.3f}   (target >= 0.97)")
            figures.append({
                "world": world, "threadsPerRank": threads, "baselineTokensPerSecond": base,
                "trainerTokensPerSecond": ours, "ratio": ours / base,
                **{f"{who}StepP{q}Ms": 1e3 * percentile(steps[who], q / 100) for who in steps for q in (50, 99)},
            })
        single = {f["world"]: f["trainerTokensPerSecond"] for f in figures if f["threadsPerRank"] == 1}
        for f in figures:
            if f["threadsPerRank"] > 1 and f["world"] in single:
                print(f"RATIO trainer tokens/s, {f['world']} rank(s), {f['threadsPerRank']} threads / 1 thread = "
                      f"{f['trainerTokensPerSecond'] / single[f['world']]:.3f}")
        if args.json is not None:
            args.json.write_text(json.dumps({"steps": args.steps, "repeats": args.repeats, "device": args.device,
                                             "cores": len(os.sched_getaffinity(0)), "results": figures}, indent=2))
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
