"""MFU of the trainyard trainer on one GPU: gpt-1b@v1 (~1.3B parameters) or llama-1b@v1 (~1.1B, the
TinyLlama shape: GQA, SwiGLU, RoPE), bf16 autocast.

Launches one ``python -m trainyard_trainer`` rank with the node agent's environment contract
(nccl, the GPU's bf16 peak from the trainer's device table) and reports the steady-state MFU the
trainer itself computes (PaLM FLOPs per token x tokens/s / peak), from its StepMetrics and run
record. Target: >= 0.50 on an H100/H200.

    python bench/gpu/mfu.py [--model llama-1b@v1] [--steps 20] [--micro-batch 8] [--accumulation 2] [--seq 2048]
    python bench/gpu/mfu.py --device cpu --model llama-tiny@v1 --steps 6 --seq 64   (a CPU smoke run)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_overhead"))
import run as overhead  # noqa: E402  (bench/trainer_overhead/run.py: the rank launcher)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--model", default="gpt-1b@v1")
    parser.add_argument("--sharding", default="ddp", help="TRAINYARD_SHARDING for the rank (ddp, fsdp, …)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a smoke run of this script (use a small --model and --seq)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the figures as JSON to FILE")
    args = parser.parse_args()
    if args.steps < overhead.WARMUP + 3:
        parser.error(f"--steps must be at least {overhead.WARMUP + 3}: the first {overhead.WARMUP} are warm-up "
                     "and the steady state needs a few more")

    import torch

    from trainyard_contract.catalog import resolve_model
    from trainyard_contract.storage import ArtifactLayout
    from trainyard.data import prepare_dataset
    from trainyard.metrics import flops_per_token

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark needs a GPU")
    root = Path(tempfile.mkdtemp(prefix="mfu-bench-")) / "artifacts"
    try:
        prepare_dataset(root, "tinycorpus", "v1")  # ~1M tokens: enough windows of 2049 for 20 steps
        config = resolve_model(args.model)
        ns = argparse.Namespace(
            steps=args.steps, device=args.device, model_json=config.model_dump(by_alias=True),
            batch={"sequenceLength": args.seq, "microBatchSize": args.micro_batch,
                   "globalBatchSize": args.micro_batch * args.accumulation},
        )
        overhead.EXTRA_ENV = {"TRAINYARD_PEAK_FLOPS": None, "TRAINYARD_SHARDING": args.sharding,
                              "TRAINYARD_LOG_LEVEL": "INFO"}
        ends = overhead.run_trainer(ns, root, 1, 0)
        layout = ArtifactLayout(root)
        job = overhead.job_id(1, 0)
        record = json.loads((layout.attempt_dir("bench", job, 1) / "run-record.json").read_text())
        events = [json.loads(line)["payload"] for line in
                  layout.rank_events("bench", job, 1, 0).read_text().splitlines()]
        all_steps = [e for e in events if e["eventType"] == "StepMetrics"]
        steps = all_steps[overhead.WARMUP:-1]
        tokens = ns.batch["globalBatchSize"] * args.seq
        steady = overhead.steady_tokens_per_second(ends, tokens)
        peak = record["throughput"]["peakFlopsPerDevice"]
        fpt = flops_per_token(config, args.seq)
        size = (f"{config.num_parameters / 1e9:.2f}B" if config.num_parameters >= 1e8
                else f"{config.num_parameters / 1e6:.2f}M")
        print(f"{args.model} ({config.architecture}): {size} parameters, {fpt / 1e9:.3g} GFLOP/token (PaLM), "
              f"batch {args.micro_batch} x {args.accumulation} x {args.seq} tokens, "
              f"{record['parallelism']['precision']}, "
              f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'} peak {peak / 1e12:.3g} TFLOP/s "
              f"({record['throughput']['peakFlopsSource']})")
        print(f"  step {statistics.median(e['stepSeconds'] for e in steps):.3f} s, "
              f"{steady:,.0f} tokens/s steady, trainer-reported MFU per step "
              f"{[round(e['mfu'], 3) for e in steps]}")
        mfu = fpt * steady / peak
        print(f"MFU (steady state, wall clock between steps) = {mfu:.3f}   (target >= 0.50 on an H100/H200)")
        if args.json is not None:
            args.json.write_text(json.dumps({
                "model": args.model, "architecture": config.architecture, "parameters": config.num_parameters,
                "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                "precision": record["parallelism"]["precision"], "steps": len(all_steps),
                "tokensPerSecond": steady, "peakFlopsPerDevice": peak, "flopsPerToken": fpt, "mfu": mfu,
            }, indent=2) + "\n")
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
