"""What the rank SDK (``import trainyard``) costs a user's training loop (printed ratios, not a test).

One user loop (a plain-PyTorch GPT, DDP over gloo, AdamW, gradient clipping, 2 CPU ranks with one
thread each), run in the same invocation, alternating:

- **plain**: ``torch.distributed`` only: random windows read from the dataset's memory-mapped
  shards, and a hand-written checkpoint (rank 0 ``torch.save`` of model + optimizer, fsync, barrier);
- **sdk**: the same loop with ``trainyard.init()``, ``run.data_loader()``, ``run.restore``,
  ``run.timing`` around data/compute/collective, ``run.report`` (a StepMetrics appended to the spool
  every step), ``run.checkpoint`` every step (the pipelined cross-rank agreement; async DCP saves,
  ShardWritten)
  and ``run.should_stop``, launched with the node agent's rank environment.

Two figures, each the best of REPEATS (interference only ever slows a run down):

- tokens/s, steady state (median interval between step ends, first WARMUP steps and the last left
  out), with no save but the final one: ``sdk / plain`` (target >= 0.98);
- checkpoint stall, saving every SAVE_EVERY steps: seconds the loop was held up per save
  (plain: the ``torch.save`` + barrier; sdk: the ``checkpoint_seconds`` its StepMetrics report,
  including the optimizer step's wait for the background copy): ``sdk / plain`` (lower is better).

    python bench/sdk_overhead/run.py [--steps 40] [--repeats 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WARMUP = 4
SAVE_EVERY = 5
WORLD = 2
MODEL = {"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 128, "maxSeqLen": 64, "dropout": 0.0}
BATCH = {"sequenceLength": 64, "microBatchSize": 8, "globalBatchSize": 32}
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt-sdk"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_wire(steps: int, every: int) -> dict[str, Any]:
    return {
        "specVersion": "v1", "modelConfig": MODEL, "dataset": "tinycorpus@v1", "codeRevision": "bench",
        "resources": {"gpuType": "cpu", "gpuCount": WORLD}, "parallelism": {"data": WORLD},
        "checkpointPolicy": {"everySteps": every},
        "training": {**BATCH, "seed": 1, "learningRate": 1e-3, "maxSteps": steps, "deterministic": False},
    }


# ----------------------------------------------------------------------------- the user loop, both ways


def rank_main(args: argparse.Namespace) -> None:
    """One rank of the loop; prints the step end times and the checkpoint stall of saves before the last step."""
    import numpy as np
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(EXAMPLE))
    from train import GPT  # the example's model: the SDK is the only difference

    spec = spec_wire(args.steps, args.every)
    cfg, t = spec["modelConfig"], spec["training"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ends: list[float] = []
    stall = 0.0
    with contextlib.ExitStack() as stack:
        if args.rank_of == "sdk":
            import trainyard

            run = stack.enter_context(trainyard.init())
            timing = run.timing
        else:
            run, timing = None, None
            torch.set_num_threads(1)
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}")
        torch.manual_seed(1)
        model = GPT(cfg["vocabSize"], cfg["nLayers"], cfg["nHeads"], cfg["dModel"], cfg["maxSeqLen"], 0.0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=t["learningRate"], betas=(0.9, 0.95), weight_decay=0.1)
        seq, micro = t["sequenceLength"], t["microBatchSize"]
        accumulation = t["globalBatchSize"] // (micro * world)
        if run is not None:
            loader = run.data_loader()
            state = {"model": trainyard.ModelState(model), "optimizer": trainyard.OptimizerState(model, opt),
                     "loader": loader}
            step = run.restore(state)
        else:
            files = sorted(Path(args.data).glob("shard-*.bin"))
            shards = [m for m in (np.memmap(p, dtype="<u2", mode="r") for p in files) if len(m) > 2 * (seq + 1)]
            rng = np.random.default_rng(rank)
            step = 0

        def plain_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
            out = []
            for _ in range(accumulation):
                rows = []
                for _ in range(micro):
                    shard = shards[rng.integers(len(shards))]
                    start = int(rng.integers((len(shard) - seq - 1) // seq)) * seq
                    rows.append(np.asarray(shard[start:start + seq + 1], dtype=np.int64))
                window = torch.from_numpy(np.stack(rows))
                out.append((window[:, :-1], window[:, 1:]))
            return out

        def timed(kind: str) -> Any:
            return getattr(timing, kind)() if timing is not None else contextlib.nullcontext()

        while step < args.steps:
            with timed("data"):
                micro_batches = next(loader) if run is not None else plain_batches()
            with timed("compute"):
                loss_sum = torch.zeros(())
                for k, (inputs, targets) in enumerate(micro_batches):
                    with ddp.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
                        loss = ddp(inputs, targets)
                        (loss / len(micro_batches)).backward()
                    loss_sum += loss.detach()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            with timed("collective"):
                mean_loss = loss_sum / len(micro_batches)
                dist.all_reduce(mean_loss)
            step += 1
            if run is not None:
                event = run.report(step, loss=mean_loss.item() / world)
                if step > 1:
                    stall += event.checkpoint_seconds  # the saves of earlier steps (the last one is not counted)
                run.checkpoint(step, state)
                if run.should_stop():
                    break
            else:
                mean_loss.item()
                if step % args.every == 0 and step < args.steps:
                    started = time.perf_counter()
                    if rank == 0:
                        path = Path(args.data).parent.parent.parent / f"plain-{os.getpid()}-{step}.pt"
                        with open(path, "wb") as f:
                            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, f)
                            f.flush()
                            os.fsync(f.fileno())
                    dist.barrier()
                    stall += time.perf_counter() - started
            ends.append(time.time())
        if run is None:
            del ddp  # a DDP Reducer freed after its group is destroyed can deadlock in gloo's destructor
            dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps({"ends": ends, "stall": stall}), flush=True)


def launch(args: argparse.Namespace, root: Path, who: str, *, steps: int, every: int, tag: str) -> dict[str, Any]:
    from trainyard_contract.events import GangAllocated, NodeAssignment, RankAssignment
    from trainyard_contract.spec import TrainingSpec
    from trainyard_contract.storage import ArtifactLayout, atomic_write_bytes

    port, layout, job = free_port(), ArtifactLayout(root), f"bench-{tag}"
    spec = TrainingSpec.model_validate(spec_wire(steps, every))
    allocation = GangAllocated(
        job_id=job, tenant="bench", attempt=1, allocation_id="a", epoch=1, world_size=WORLD, master_addr="127.0.0.1",
        master_port=port, spec=spec, spec_hash=spec.spec_hash(),
        nodes=[NodeAssignment(node_id="n", host="localhost",
                              ranks=[RankAssignment(rank=r, local_rank=r, device_index=r) for r in range(WORLD)])])
    alloc_file = layout.attempt_dir("bench", job, 1) / "allocation.json"
    atomic_write_bytes(alloc_file, allocation.to_bytes())
    data = root / "datasets" / "tinycorpus" / "v1"
    argv = [sys.executable, __file__, "--rank-of", who, "--steps", str(steps), "--every", str(every),
            "--data", str(data)]
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "OTEL_"))}
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OTEL_TRACES_EXPORTER": "none",
            "OMP_NUM_THREADS": "1", "TRAINYARD_BACKEND": "gloo", "TRAINYARD_JOB_ID": job, "TRAINYARD_TENANT": "bench",
            "TRAINYARD_ATTEMPT": "1", "TRAINYARD_EPOCH": "1", "TRAINYARD_ALLOCATION_ID": "a",
            "TRAINYARD_ARTIFACT_ROOT": str(root), "TRAINYARD_ALLOCATION_FILE": str(alloc_file),
            "TRAINYARD_EVENTS_FILE": str(layout.rank_events("bench", job, 1, rank)),
            "TRAINYARD_LOG_LEVEL": "WARNING",
        })
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 600
    while any(p.poll() is None for p in procs):  # one rank failing must not leave the other waiting in a collective
        if any(p.poll() for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
        time.sleep(0.05)
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{who} ranks failed: {[p.returncode for p in procs]}")
    line = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def steady_tokens_per_second(ends: list[float], tokens_per_step: int) -> float:
    window = ends[WARMUP - 1:-1]
    return tokens_per_step / statistics.median(b - a for a, b in zip(window, window[1:], strict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--rank-of", choices=["plain", "sdk"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--every", type=int, default=SAVE_EVERY, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        rank_main(args)
        return

    from trainyard.data import STDLIB_SOURCES, prepare_dataset

    root = Path(tempfile.mkdtemp(prefix="sdk-overhead-")) / "artifacts"
    tokens = BATCH["globalBatchSize"] * BATCH["sequenceLength"]
    throughput: dict[str, list[float]] = {"plain": [], "sdk": []}
    stall: dict[str, list[float]] = {"plain": [], "sdk": []}
    saves = (args.steps - 1) // SAVE_EVERY
    try:
        prepare_dataset(root, "tinycorpus", "v1", sources=STDLIB_SOURCES[:12])
        for run in range(args.repeats):
            order = ("plain", "sdk") if run % 2 == 0 else ("sdk", "plain")
            for who in order:
                result = launch(args, root, who, steps=args.steps, every=1_000_000, tag=f"{who}-tput-{run}")
                throughput[who].append(steady_tokens_per_second(result["ends"], tokens))
            for who in order:
                result = launch(args, root, who, steps=args.steps, every=SAVE_EVERY, tag=f"{who}-ckpt-{run}")
                stall[who].append(result["stall"] / saves)
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    plain_tps, sdk_tps = max(throughput["plain"]), max(throughput["sdk"])
    plain_stall, sdk_stall = min(stall["plain"]), min(stall["sdk"])
    results = {
        "model": MODEL, "batch": BATCH, "world": WORLD, "steps": args.steps, "repeats": args.repeats,
        "tokens_per_second": {"plain": plain_tps, "sdk": sdk_tps, "runs": throughput},
        "stall_seconds_per_save": {"plain": plain_stall, "sdk": sdk_stall, "every_steps": SAVE_EVERY, "runs": stall},
        "ratio_tokens_per_second": sdk_tps / plain_tps,
        "ratio_checkpoint_stall": sdk_stall / plain_stall if plain_stall > 0 else None,
    }
    print(f"model {MODEL}, batch {BATCH}, {WORLD} gloo ranks, {args.steps} steps (best of {args.repeats})")
    print(f"  tokens/s (steady state): plain {plain_tps:9.1f}   sdk {sdk_tps:9.1f}   runs {throughput}")
    print(f"  stall per save (every {SAVE_EVERY} steps): plain {plain_stall * 1e3:8.1f} ms   "
          f"sdk {sdk_stall * 1e3:8.1f} ms")
    per_step_ms = (tokens / sdk_tps - tokens / plain_tps) * 1e3
    results["sdk_cost_ms_per_step"] = per_step_ms
    print(f"  step time: plain {tokens / plain_tps * 1e3:.1f} ms, sdk {tokens / sdk_tps * 1e3:.1f} ms "
          f"({per_step_ms:+.2f} ms per step: the StepMetrics spool line, the boundary agreement, timing)")
    print(f"RATIO sdk/plain tokens/s = {results['ratio_tokens_per_second']:.3f}   (target >= 0.98)")
    if results["ratio_checkpoint_stall"] is not None:
        print(f"RATIO sdk/plain checkpoint stall = {results['ratio_checkpoint_stall']:.3f}   (lower is better)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
