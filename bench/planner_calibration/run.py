"""Planner calibration on this machine: predicted vs measured step time and checkpoint write time.

    python bench/planner_calibration/run.py [--quick] [--json results.json]

A benchmark, not a test: it prints figures and ratios, never fails on them. Under two minutes.

(a) Step time of the example job (examples/tiny.yaml: dp 2, micro-batch 8, sequence 64, global
    batch 32) for gpt-tiny@v1 and gpt-small@v1, measured as the real trainer's ``train_step`` in
    two real gloo ranks (one thread each, as ``configure_determinism`` sets them). Predicted by
    ``estimate_step`` on ``cpu_device(peak)``, the peak a 1024x1024 fp32 matmul probe reaches on
    one thread, with the layout and bytes per parameter the API's submission check uses.
    Calibrated by ``fit`` on a *different* measurement, never the checked one: the same model
    with another batch shape (micro-batch 4, sequence 128), interleaved step by step with the
    checked shape so both see the same machine load. The other model's calibration is shown
    too: one factor per device type across a 60x range of model size.

(b) Checkpoint write time of the same model state (weights, AdamW moments, scheduler, sampler,
    RNG) through the trainer's ``save_checkpoint`` (DCP, fsync, rename, sha256 of the shard), in
    a one-rank world. Predicted by ``write_seconds(checkpoint_bytes(N, FP32_ADAM), bandwidth)``
    with the bandwidth of a raw fsync'd sequential write of a file the size of the checkpoint,
    interleaved with the saves. Calibrated by ``fit`` on other saves of the same state (the job's
    earlier checkpoints, what the checkpoint coordinator has seen when it advises the next
    interval), interleaved with the checked saves but never among them; a weights-only save (a
    third of the bytes) and the other model's save are shown as alternative calibrations.

Every measured figure is the median of repetitions after a warm-up, the checked and the
calibration measurements interleaved so that both see the same load on this shared host (the
calibration then cancels it); the fastest repetition is printed beside it, all of them are
written with ``--json``.

The trainer is driven read-only through its public pieces (build_model, apply_ddp,
build_optimizer, train_step, checkpoint_state, save_checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainyard_api.planning import trainer_bytes_per_parameter, trainer_layout, transformer_for
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_contract.spec import TrainingSpec
from trainyard_planner import (
    FP32_ADAM,
    Sample,
    SampleKind,
    Topology,
    checkpoint_bytes,
    compare,
    cpu_device,
    estimate_step,
    fit,
    write_seconds,
)
from trainyard.checkpoint import save_checkpoint
from trainyard_trainer.model import build_model
from trainyard_trainer.parallel import CollectiveTimer, apply_ddp
from trainyard.runtime import Runtime, configure_determinism
from trainyard.sampler import GlobalSampler
from trainyard_trainer.schedule import build_lr_scheduler
from trainyard.state import ModelState, Progress, RngState, checkpoint_state
from trainyard_trainer.training import build_optimizer, train_step

MODELS = ("gpt-tiny@v1", "gpt-small@v1")
WORLD = 2
CPU = Runtime(torch.device("cpu"), "gloo", None)
TOLERANCE_PCT = 15.0


@dataclass(frozen=True)
class Shape:
    """One rank's share of a step: ``microbatches`` micro-batches of ``micro x seq`` tokens."""

    label: str
    micro: int
    seq: int
    microbatches: int

    def spec(self) -> TrainingSpec:
        training = {**EXAMPLE_SPEC["training"], "microBatchSize": self.micro, "sequenceLength": self.seq,
                    "globalBatchSize": self.micro * WORLD * self.microbatches}
        return TrainingSpec.model_validate({**EXAMPLE_SPEC, "training": training})


def _example() -> Shape:
    """The batch of examples/tiny.yaml (``EXAMPLE_SPEC``; a unit test keeps the two equal)."""
    spec = TrainingSpec.model_validate(EXAMPLE_SPEC)
    t, m = spec.training, spec.grad_accumulation
    assert spec.parallelism.data == WORLD
    return Shape(f"example batch (micro {t.micro_batch_size} x seq {t.sequence_length} x {m}, dp {WORLD})",
                 t.micro_batch_size, t.sequence_length, m)


EXAMPLE = _example()
CALIBRATION = Shape(f"calibration batch (micro 4 x seq 128 x {EXAMPLE.microbatches}, dp {WORLD})", 4, 128,
                    EXAMPLE.microbatches)


# ----------------------------------------------------------------------------- measurements


def matmul_peak(n: int = 1024, repeats: int = 7) -> float:
    """FLOP/s of the best of ``repeats`` n x n fp32 matmuls on one thread (the ranks' setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / best


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _batches(shape: Shape, vocab: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(shape.microbatches):
        tokens = torch.randint(0, vocab, (shape.micro, shape.seq + 1), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _rank_main(rank: int, init: str, steps: int, out_path: str) -> None:
    """One gloo rank: per model, alternate the calibration and the example shape step by step."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    configure_determinism(CPU, seed=1234, rank=rank, deterministic=True)
    generator = torch.Generator().manual_seed(rank)
    times: dict[str, dict[str, list[float]]] = {}
    for ref in MODELS:
        config = MODEL_CATALOG[ref]
        timer = CollectiveTimer()
        ddp = apply_ddp(build_model(config, seed=1234, device=CPU.device), device=CPU.device, timer=timer)
        spec = EXAMPLE.spec()
        optimizer = build_optimizer(ddp.module, spec)
        schedule = build_lr_scheduler(optimizer, schedule=spec.training.lr_schedule, max_steps=10_000)
        runs = {s.label: [] for s in (CALIBRATION, EXAMPLE)}
        pairs = steps if ref == MODELS[0] else max(3, steps // 4)  # gpt-small's steps take ~20x longer
        for i in range(1 + pairs):  # the first pair warms up
            for shape in (CALIBRATION, EXAMPLE) if i % 2 else (EXAMPLE, CALIBRATION):
                batches = _batches(shape, config.vocab_size, generator)
                dist.barrier()
                seconds = _timed(lambda b=batches: train_step(ddp, optimizer, schedule, b, runtime=CPU, timer=timer,  # noqa: B023 - timed at once
                                                              grad_clip=1.0, world_size=WORLD))
                if i >= 1:
                    runs[shape.label].append(seconds)
        times[ref] = runs
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, times)
    if rank == 0:  # a step ends when its slowest rank does
        slowest = {ref: {label: [max(per_rank) for per_rank in zip(*(g[ref][label] for g in gathered))]
                         for label in times[ref]} for ref in MODELS}
        Path(out_path).write_text(json.dumps(slowest))
    dist.barrier()  # both ranks leave together; a lone destroy can wait on its peer
    dist.destroy_process_group()


def measure_steps(workdir: Path, steps: int) -> dict[str, dict[str, list[float]]]:
    """Step seconds per model and shape (each step's slowest rank), from two real gloo ranks."""
    out = workdir / "steps.json"
    mp.spawn(_rank_main, args=(f"file://{workdir / 'pg-steps'}", steps, str(out)), nprocs=WORLD, join=True)
    return json.loads(out.read_text())


def raw_write_seconds(path: Path, size: int, chunk: int = 8 << 20) -> float:
    """A sequential write of ``size`` fresh bytes, flushed and fsync'd, the way a shard is made durable."""
    block = os.urandom(min(size, chunk))
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


@dataclass
class SaveTimes:
    """Seconds per save round (round 0 warms DCP up) and the bytes each kind of save wrote."""

    parameters: int
    full_bytes: int
    weights_bytes: int
    raw: list[float]
    full: list[float]
    weights: list[float]

    @property
    def raw_bandwidth(self) -> float:
        """Bytes/s of the median raw write of a file the checkpoint's size."""
        return self.full_bytes / statistics.median(self.raw[1:])




def measure_saves(workdir: Path, rounds: int) -> dict[str, SaveTimes]:
    """Raw writes, full saves and weights-only saves per model, interleaved, in a one-rank world."""
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'pg-saves'}", rank=0, world_size=1)
    root = workdir / "checkpoints"
    results: dict[str, SaveTimes] = {}
    try:
        for ref in MODELS:
            config = MODEL_CATALOG[ref]
            timer = CollectiveTimer()
            ddp = apply_ddp(build_model(config, seed=1234, device=CPU.device), device=CPU.device, timer=timer)
            spec = EXAMPLE.spec()
            optimizer = build_optimizer(ddp.module, spec)
            schedule = build_lr_scheduler(optimizer, schedule=spec.training.lr_schedule, max_steps=10_000)
            train_step(ddp, optimizer, schedule, _batches(EXAMPLE, config.vocab_size, torch.Generator()),
                       runtime=CPU, timer=timer, grad_clip=1.0, world_size=1)  # AdamW moments exist from here
            state = checkpoint_state(
                model=ddp, optimizer=optimizer, lr_scheduler=schedule,
                sampler=GlobalSampler(10_000, seed=1234, global_batch=32, micro_batch=8, dp=1, dp_rank=0),
                progress=Progress(), rng=RngState(0, CPU.device, seed=1234),
            )
            runs: dict[str, list[float]] = {"full": [], "weights": [], "raw": []}
            sizes: dict[str, int] = {}
            pairs = 2 * rounds if ref == MODELS[0] else rounds  # gpt-tiny's saves are cheap: take more
            for i in range(1 + 2 * pairs):  # round 0 warms up; odd rounds calibrate, even rounds are checked
                for kind, target in (("full", state), ("weights", {"model": ModelState(ddp)})):
                    saved = save_checkpoint(target, root / f"{ref}-{kind}-{i}", rank=0, barrier=dist.barrier)
                    sizes[kind] = saved.shard.size_bytes + sum(f.size_bytes for f in saved.extra_files)
                    runs[kind].append(saved.seconds)
                    shutil.rmtree(saved.directory)
                runs["raw"].append(raw_write_seconds(root / "raw.bin", sizes["full"]))
            results[ref] = SaveTimes(parameters=config.num_parameters, full_bytes=sizes["full"],
                                     weights_bytes=sizes["weights"], **runs)
    finally:
        dist.destroy_process_group()
    return results


# ----------------------------------------------------------------------------- predictions


def predict_step(ref: str, shape: Shape, peak: float) -> float:
    """The planner's step time for ``shape`` on two CPU ranks, as the submission check sees the job."""
    spec = shape.spec()
    device = cpu_device(peak, memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                        devices_per_node=WORLD)
    model = transformer_for(MODEL_CATALOG[ref], shape.seq)
    estimate = estimate_step(model, trainer_layout(spec), device, Topology.for_device(device),
                             bytes_per_parameter=trainer_bytes_per_parameter(spec))
    return estimate.step_seconds


def _sample(kind: SampleKind, label: str, predicted: float, measured: list[float]) -> Sample:
    return Sample(kind=kind, device_type="cpu", label=label, predicted=predicted, measured=statistics.median(measured))


def _checked(sample: Sample, measured: list[float], sources: list[Sample]) -> dict[str, Any]:
    """Raw prediction against the measurement, then calibrated by each source (never by ``sample``)."""
    raw = compare([sample])[0]
    calibrations = []
    for source in sources:
        assert source is not sample
        calibrated = compare([sample], fit([source]))[0]
        calibrations.append({"on": source.label, "calibrated": calibrated.calibrated,
                             "errorPct": calibrated.calibrated_error_pct,
                             "within": abs(calibrated.calibrated_error_pct) <= TOLERANCE_PCT})
    return {"checked": sample.label, "measured": sample.measured, "fastest": min(measured),
            "predicted": raw.predicted, "errorPct": raw.error_pct, "calibrations": calibrations}


def step_comparisons(measured: dict[str, dict[str, list[float]]], peak: float) -> list[dict[str, Any]]:
    samples = {(ref, shape): _sample(SampleKind.STEP_TIME, f"{ref}, {shape.label}", predict_step(ref, shape, peak),
                                     measured[ref][shape.label])
               for ref in MODELS for shape in (EXAMPLE, CALIBRATION)}
    rows = []
    for ref in MODELS:
        other = next(r for r in MODELS if r != ref)
        rows.append(_checked(samples[(ref, EXAMPLE)], measured[ref][EXAMPLE.label],
                             [samples[(ref, CALIBRATION)], samples[(other, CALIBRATION)]]))
    return rows


def checkpoint_comparisons(saves: dict[str, SaveTimes]) -> list[dict[str, Any]]:
    kind = SampleKind.CHECKPOINT_WRITE
    checked, earlier, weights = {}, {}, {}
    for ref, s in saves.items():
        full = write_seconds(checkpoint_bytes(s.parameters, FP32_ADAM), s.raw_bandwidth)
        checked[ref] = _sample(kind, f"{ref}, full training state", full, s.full[2::2])
        earlier[ref] = _sample(kind, f"{ref}, other saves of the same state", full, s.full[1::2])
        weights[ref] = _sample(kind, f"{ref}, weights-only save",
                               write_seconds(s.parameters * FP32_ADAM.weights, s.raw_bandwidth), s.weights[1:])
    rows = []
    for ref in MODELS:
        other = next(r for r in MODELS if r != ref)
        rows.append(_checked(checked[ref], saves[ref].full[2::2],
                             [earlier[ref], weights[ref], checked[other]]))
    return rows


# ----------------------------------------------------------------------------- report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def print_comparisons(title: str, rows: list[dict[str, Any]]) -> None:
    """Each checked figure, its raw prediction, then each calibration (the first is the headline)."""
    print(f"\n{title}")
    for r in rows:
        print(f"  {r['checked']}")
        print(f"      measured {_ms(r['measured'])} (fastest {_ms(r['fastest'])}); "
              f"predicted {_ms(r['predicted'])}, {r['errorPct']:+.0f} %")
        for i, c in enumerate(r["calibrations"]):
            verdict = f"within ±{TOLERANCE_PCT:.0f} %" if c["within"] else f"outside ±{TOLERANCE_PCT:.0f} %"
            print(f"      {'calibrated' if i == 0 else '   instead'} on {c['on']:<58} {_ms(c['calibrated']):>10} "
                  f"{c['errorPct']:+7.1f} %  {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (noisier)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    steps, rounds = (8, 2) if args.quick else (24, 4)
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="trainyard-calibration-"))
    try:
        peak = matmul_peak()
        print(f"matmul probe: {peak / 1e9:.1f} GFLOP/s fp32 on one thread (cpu_device peak)")
        step_times = measure_steps(workdir, steps)
        step_rows = step_comparisons(step_times, peak)
        saves = measure_saves(workdir, rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for ref, s in saves.items():
        print(f"raw fsync'd sequential write of {ref}'s checkpoint size ({s.full_bytes / 1e6:.1f} MB): "
              f"{s.raw_bandwidth / 1e6:.0f} MB/s")
    checkpoint_rows = checkpoint_comparisons(saves)
    print_comparisons("(a) step time: the trainer's train_step in two gloo ranks; predicted by estimate_step "
                      "(the kernel model: matmul share by shape) on cpu_device(probe peak)", step_rows)
    print_comparisons("(b) checkpoint write time: the trainer's save_checkpoint (DCP, fsync, rename, sha256), one "
                      "rank; predicted as checkpoint_bytes(N, FP32_ADAM) / raw write bandwidth", checkpoint_rows)
    print(f"\n{time.perf_counter() - started:.0f} s in all; figures, not a pass/fail test.")
    if args.json:
        args.json.write_text(json.dumps({"peakFlops": peak, "steps": step_rows, "checkpoints": checkpoint_rows,
                                         "stepSeconds": step_times, "saves": {k: asdict(v) for k, v in saves.items()}},
                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
