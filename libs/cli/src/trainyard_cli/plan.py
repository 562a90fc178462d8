"""``trainyard plan …``: the capacity arithmetic to do before choosing a layout.

Runs :mod:`trainyard_planner` on this machine (no API, no token): ``memory``, ``compute``,
``comm``, ``bubble``, ``checkpoint`` and ``recommend``. Each prints a table for a human, or with
``--json`` the planner's camelCase result (the same objects ``POST /v1/plan`` answers with).
``calibration`` is the exception: it asks the API (``GET /v1/plan/calibration``) what the platform
measured per device type against what the planner predicted.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from pydantic import ValidationError
from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from trainyard_contract.catalog import MODEL_CATALOG, ModelConfig
from trainyard_contract.errors import ConfigError
from trainyard_planner import (
    DEFAULT_HEADROOM,
    FP32_ADAM,
    MIXED_PRECISION_ADAM,
    BytesPerParameter,
    Candidate,
    DeviceSpec,
    FlopsCount,
    Layout,
    LinkTier,
    MemoryBreakdown,
    Recompute,
    RejectedLayout,
    Schedule,
    StepEstimate,
    Topology,
    Transformer,
    ZeroStage,
    attention_flops_per_token,
    bubble_fraction,
    bubble_ratio,
    checkpoint_bytes,
    estimate_memory,
    estimate_step,
    hardware_flops_per_token,
    hardware_training_flops,
    inflight_microbatches,
    job_mtbf,
    model_flops_per_token,
    plan_checkpoint,
    recommend,
    resolve_device,
    training_flops,
    training_time,
    transformer_for,
)

from trainyard_cli.client import ApiClient
from trainyard_cli.session import api_session
from trainyard_cli.config import CliConfig, load_spec, resolve_api_url, resolve_token
from trainyard_cli.console import error, stdout

T = TypeVar("T")

plan_app = typer.Typer(
    help="Capacity planning before you train: memory per device, compute, communication, pipeline "
         "bubble, checkpoint interval, and ranked layouts. Runs locally; --json for machines.",
    epilog="Examples (each command's --help has more):\n\n"
           "trainyard plan memory --params 70e9 --dp 1 --zero-stage 0\n\n"
           "trainyard plan recommend --params 70e9 --devices 256 --global-batch 1024\n\n"
           "trainyard plan checkpoint --size-gb 1000 --write-bandwidth 10\n\n"
           "trainyard plan calibration   (asks the API: measured vs predicted per device type)",
    no_args_is_help=True,
)


GB = 1e9
PRECISIONS = {"mixed": MIXED_PRECISION_ADAM, "fp32": FP32_ADAM}
DEFAULT_DEVICE_MTBF_HOURS = 50_000.0  # Llama 3: ~3.1 h per interruption on 16,384 H100s


# ----------------------------------------------------------------------------- options

ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", show_default=False, rich_help_panel="Model",
    help="catalog reference (gpt-1b@v1), a YAML/JSON file holding a model or a training spec, or inline JSON")]
ParamsOpt = Annotated[float | None, typer.Option(
    "--params", show_default=False, rich_help_panel="Model",
    help="a parameter count instead of --model (70e9); a GPT shape is guessed for activations (vocabulary "
         "--vocab, width/depth near GPT-3's 128): give --model with the shape for a published model")]
SeqLenOpt = Annotated[int | None, typer.Option(
    "--seq-len", min=1, show_default=False, rich_help_panel="Model",
    help="training sequence length (default: the model's maxSeqLen, the spec's, or 2048 with --params)")]
VocabOpt = Annotated[int, typer.Option("--vocab", min=1, rich_help_panel="Model", help="vocabulary with --params")]
PrecisionOpt = Annotated[str, typer.Option(
    "--precision", rich_help_panel="Model",
    help="mixed: bf16 weights/grads + fp32 master and Adam (16 B/param); fp32: fp32 weights/grads + Adam (16 B)")]

DpOpt = Annotated[int, typer.Option("--dp", min=1, rich_help_panel="Layout", help="data-parallel degree")]
TpOpt = Annotated[int, typer.Option("--tp", min=1, rich_help_panel="Layout", help="tensor-parallel degree")]
PpOpt = Annotated[int, typer.Option("--pp", min=1, rich_help_panel="Layout", help="pipeline stages")]
ZeroOpt = Annotated[int, typer.Option(
    "--zero-stage", min=0, max=3, rich_help_panel="Layout", help="0 DDP, 1 optimizer, 2 + gradients, 3 FSDP")]
MicroOpt = Annotated[int, typer.Option("--micro-batch", min=1, rich_help_panel="Layout",
                                       help="sequences per micro-batch per rank")]
MicrobatchesOpt = Annotated[int, typer.Option("--microbatches", min=1, rich_help_panel="Layout",
                                              help="micro-batches per step (gradient accumulation)")]
SeqParOpt = Annotated[bool, typer.Option("--sequence-parallel/--no-sequence-parallel", rich_help_panel="Layout",
                                         help="sequence parallelism with --tp")]
RecomputeOpt = Annotated[Recompute, typer.Option("--recompute", rich_help_panel="Layout",
                                                 help="activation recomputation")]
ScheduleOpt = Annotated[Schedule, typer.Option("--schedule", rich_help_panel="Layout", help="pipeline schedule")]
VirtualOpt = Annotated[int, typer.Option("--virtual-stages", min=1, rich_help_panel="Layout",
                                         help="model chunks per device (interleaved schedule)")]

DeviceOpt = Annotated[str, typer.Option(
    "--device", rich_help_panel="Devices", help="device type: a100-40gb, a100-80gb, h100-80gb, h200-141gb "
                                                "(or anything, with --peak-tflops and --memory-gb)")]
DevicesOpt = Annotated[int | None, typer.Option("--devices", min=1, show_default=False, rich_help_panel="Devices",
                                                help="device count (default: dp x tp x pp)")]
PeakOpt = Annotated[float | None, typer.Option("--peak-tflops", min=0.001, show_default=False,
                                               rich_help_panel="Devices", help="override the dense bf16 peak")]
MemoryOpt = Annotated[float | None, typer.Option("--memory-gb", min=0.001, show_default=False,
                                                 rich_help_panel="Devices", help="override the memory per device")]
PerNodeOpt = Annotated[int | None, typer.Option("--devices-per-node", min=1, show_default=False,
                                                rich_help_panel="Topology", help="default: the NVLink domain (8)")]
PerRackOpt = Annotated[int, typer.Option("--nodes-per-rack", min=1, rich_help_panel="Topology")]
NvlinkOpt = Annotated[float | None, typer.Option("--nvlink-bandwidth", min=0.001, show_default=False,
                                                 rich_help_panel="Topology", help="GB/s per device, one way")]
NetworkOpt = Annotated[float | None, typer.Option("--network-bandwidth", min=0.001, show_default=False,
                                                  rich_help_panel="Topology",
                                                  help="GB/s per device across nodes in a rack (its NIC)")]
CrossRackOpt = Annotated[float | None, typer.Option("--cross-rack-bandwidth", min=0.001, show_default=False,
                                                    rich_help_panel="Topology",
                                                    help="GB/s per device across racks (default: --network-bandwidth)")]

HeadroomOpt = Annotated[float, typer.Option("--headroom", min=0.0, max=0.99,
                                            help="memory kept free for workspace and fragmentation")]
EfficiencyOpt = Annotated[float | None, typer.Option(
    "--efficiency", min=0.001, max=1.0, show_default=False,
    help="share of peak the matmuls reach (default: by their shape and the device: A100 0.80, H100 0.60 for "
         "large ones)")]
OverlapOpt = Annotated[float | None, typer.Option(
    "--dp-overlap", min=0.0, max=1.0, show_default=False,
    help="share of data-parallel communication hidden by the backward (default: as DDP and FSDP hide it)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the planner's JSON (camelCase) instead of a table")]


# ----------------------------------------------------------------------------- inputs


def _fail(message: str) -> NoReturn:
    error(message)
    raise typer.Exit(2)


def _build(what: str, build: Callable[[], T]) -> T:
    """Planner errors are one line naming the option group and exit 2."""
    try:
        return build()
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or what}: {e['msg']}" for e in exc.errors())
        _fail(f"{what}: {problems}")
    except (ValueError, KeyError) as exc:
        _fail(f"{what}: {exc.args[0] if exc.args else exc}")


def resolve_model(model: str | None, params: float | None, seq_len: int | None,
                  vocab: int = 32_000) -> tuple[Transformer, str]:
    """(shape, label) from --model or --params; exactly one is needed."""
    if (model is None) == (params is None):
        _fail("give a model: --model gpt-1b@v1 (a catalog reference, a file or inline JSON) or --params 70e9")
    if params is not None:
        shape = _build("--params", lambda: Transformer.from_parameters(params, seq_len=seq_len or 2048,
                                                                         vocab_size=vocab))
        return shape, "parameter count"
    assert model is not None
    config, label, spec_seq = _model_config(model)
    seq = seq_len or spec_seq
    if seq is not None and seq > config.max_seq_len:
        _fail(f"--seq-len {seq} exceeds maxSeqLen {config.max_seq_len} of {label}")
    return _build("--model", lambda: transformer_for(config, seq)), label


def _model_config(model: str) -> tuple[ModelConfig, str, int | None]:
    """A ModelConfig from a catalog reference, a model or spec file, or inline JSON."""
    if model in MODEL_CATALOG:
        return MODEL_CATALOG[model], model, None
    seq_len = None
    if model.lstrip().startswith("{"):
        data: Any = _build("--model", lambda: json.loads(model))
        label = "inline model"
    elif Path(model).is_file():
        try:
            data = load_spec(Path(model))
        except ConfigError as exc:
            _fail(exc.message)
        label = model
        if "modelConfig" in data:  # a training spec: its model and sequence length
            seq_len = (data.get("training") or {}).get("sequenceLength")
            data = data["modelConfig"]
            if isinstance(data, str):
                return _model_config(data)[0], f"{data} (from {model})", seq_len
    else:
        _fail(f"unknown model {model!r}: the catalog has {', '.join(sorted(MODEL_CATALOG))}; "
              "or give a file, inline JSON, or --params")
    return _build("--model", lambda: ModelConfig.model_validate(data)), label, seq_len


def resolve_layout(**fields: Any) -> Layout:
    return _build("layout", lambda: Layout(**fields))


def device_option(name: str, peak_tflops: float | None = None, memory_gb: float | None = None) -> DeviceSpec:
    """--device as :func:`trainyard_planner.resolve_device` reads it: a known type with optional overrides,
    or a custom one from --peak-tflops and --memory-gb."""
    try:
        return resolve_device(name, peak_flops=None if peak_tflops is None else peak_tflops * 1e12,
                              memory_bytes=None if memory_gb is None else memory_gb * GB)
    except KeyError as exc:
        _fail(f"{exc.args[0]}; or describe it with --peak-tflops and --memory-gb")


def resolve_topology(device: DeviceSpec, devices_per_node: int | None, nodes_per_rack: int,
                     nvlink: float | None, network: float | None, cross_rack: float | None) -> Topology:
    """The device's links, with overrides in GB/s; cross-rack follows --network-bandwidth unless given
    (a non-blocking fabric)."""
    cross_rack = cross_rack or network
    base = Topology.for_device(device, devices_per_node=devices_per_node, nodes_per_rack=nodes_per_rack,
                               cross_rack_bandwidth=cross_rack and cross_rack * GB)
    overrides = {name: LinkTier(bandwidth=gbs * GB, latency=getattr(base, name).latency)
                 for name, gbs in (("nvlink", nvlink), ("intra_rack", network)) if gbs}
    return base.model_copy(update=overrides)


def resolve_precision(name: str) -> BytesPerParameter:
    if name not in PRECISIONS:
        _fail(f"--precision must be one of {', '.join(PRECISIONS)}, not {name!r}")
    return PRECISIONS[name]


# ----------------------------------------------------------------------------- formatting


def fmt_bytes(n: float) -> str:
    """Decimal units, as device memory and bandwidth are quoted: 1.12 TB, 80 GB, 2.4 MB."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    for unit, scale, limit in (("days", 86_400, 2 * 86_400), ("h", 3600, 7200), ("min", 60, 120), ("s", 1, 1)):
        if s >= limit:
            return f"{s / scale:.3g} {unit}"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _table(title: str, rows: Sequence[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table


def _emit(as_json: bool, data: Callable[[], Any], view: Callable[[], RenderableType]) -> None:
    if as_json:
        typer.echo(json.dumps(data(), indent=2))
    else:
        stdout().print(view())


def _model_wire(model: Transformer, label: str) -> dict[str, Any]:
    return {"source": label, "parameters": model.parameters, "exactParameters": model.exact_parameters,
            "nLayers": model.n_layers, "dModel": model.d_model, "nHeads": model.n_heads, "dFf": model.ffn_width,
            "vocabSize": model.vocab_size, "seqLen": model.seq_len}


def _model_line(model: Transformer, label: str) -> Text:
    guessed = label == "parameter count"
    shape = "shape guessed from the count: " if guessed else f"{label}: "
    line = (f"{fmt_count(model.parameters)} parameters ({shape}{model.n_layers} layers x {model.d_model} wide, "
            f"{model.n_heads} heads, vocabulary {model.vocab_size}, sequence {model.seq_len})")
    if guessed:  # a published model's own shape differs (Megatron's 1T is 128 layers x 25600, 160 heads)
        line += ("\nfor a published model give its shape: --model '{\"nLayers\": 128, \"dModel\": 25600, "
                 "\"nHeads\": 160, \"vocabSize\": 51200, \"maxSeqLen\": 2048}' (or a YAML file)")
    return Text(line, style="dim")


def memory_rows(memory: MemoryBreakdown) -> list[tuple[str, str]]:
    m = memory
    return [
        ("parameters per device", fmt_count(m.parameters_per_device)),
        ("weights", fmt_bytes(m.weights_bytes_per_device)),
        ("gradients", fmt_bytes(m.gradients_bytes_per_device)),
        ("optimizer (master + moments)", fmt_bytes(m.optimizer_bytes_per_device)),
        ("model states per device", fmt_bytes(m.model_states_bytes_per_device)),
        ("model states, whole model", fmt_bytes(m.model_states_bytes_total)),
        ("activations per layer", fmt_bytes(m.activation_bytes_per_layer)),
        ("activations per device", fmt_bytes(m.activations_bytes_per_device)),
        ("used per device", fmt_bytes(m.used_bytes_per_device)),
        (f"needed with {m.headroom:.0%} headroom", fmt_bytes(m.required_bytes_per_device)),
    ]


def short_layout(layout: Layout | Candidate) -> str:
    """``64×8sp×16i8 z2 mb1×32 none``: dp×tp×pp (``sp`` sequence parallel, ``c16`` context parallel, ``i8`` the
    interleaved schedule with 8 chunks), ZeRO stage, micro-batch × micro-batches, recomputation."""
    chunks = layout.interleaving if isinstance(layout, Layout) else layout.virtual_stages
    count = f"×{layout.microbatches}" if isinstance(layout, Layout) else ""
    tp = f"{layout.tp}{'sp' if layout.sequence_parallel and layout.tp > 1 else ''}"
    cp = f"c{layout.cp}×" if layout.cp > 1 else ""
    pp = f"{layout.pp}{f'i{chunks}' if chunks > 1 else ''}"
    return f"{layout.dp}×{cp}{tp}×{pp} z{int(layout.zero_stage)} mb{layout.micro_batch}{count} {layout.recompute.value}"


def _verdict(memory: MemoryBreakdown, device: DeviceSpec) -> Text:
    reason = memory.shortfall(device.memory_bytes)
    if reason is None:
        return Text(f"fits one {device.name} ({fmt_bytes(device.memory_bytes)})", style="green")
    return Text(f"does not fit one {device.name}: {reason}", style="bold red")


# ----------------------------------------------------------------------------- commands


@plan_app.command("memory")
def memory_command(
    model: ModelOpt = None, params: ParamsOpt = None, seq_len: SeqLenOpt = None, vocab: VocabOpt = 32_000,
    precision: PrecisionOpt = "mixed",
    dp: DpOpt = 1, tp: TpOpt = 1, pp: PpOpt = 1, zero_stage: ZeroOpt = 0, micro_batch: MicroOpt = 1,
    microbatches: MicrobatchesOpt = 1, sequence_parallel: SeqParOpt = False, recompute: RecomputeOpt = Recompute.NONE,
    schedule: ScheduleOpt = Schedule.ONE_F_ONE_B, virtual_stages: VirtualOpt = 1,
    device: Annotated[str | None, typer.Option("--device", show_default=False, rich_help_panel="Devices",
                                               help="say whether it fits this device type")] = None,
    memory_gb: MemoryOpt = None, headroom: HeadroomOpt = DEFAULT_HEADROOM, as_json: JsonOpt = False,
) -> None:
    """Memory per device: model states under ZeRO / TP / PP, plus activations.

    The seed's 70B with mixed-precision Adam (16 B per parameter) holds
    1.12 TB of model states before any activation:

        trainyard plan memory --params 70e9 --dp 1 --zero-stage 0

    ZeRO-3 over 64 ranks, tensor 8, selective recomputation, on H100s:

        trainyard plan memory --params 70e9 --dp 64 --tp 8 --zero-stage 3
        --sequence-parallel --recompute selective --device h100-80gb
    """
    shape, label = resolve_model(model, params, seq_len, vocab)
    layout = resolve_layout(dp=dp, tp=tp, pp=pp, zero_stage=ZeroStage(zero_stage), micro_batch=micro_batch,
                            microbatches=microbatches, sequence_parallel=sequence_parallel, recompute=recompute,
                            schedule=schedule, virtual_stages=virtual_stages)
    target = device_option(device, memory_gb=memory_gb) if device else None
    memory = _build("memory", lambda: estimate_memory(shape, layout, bytes_per_parameter=resolve_precision(precision),
                                                      headroom=headroom))

    def data() -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if target is not None:
            extra = {"device": target.name, "deviceMemoryBytes": target.memory_bytes,
                     "fits": memory.fits(target.memory_bytes), "shortfall": memory.shortfall(target.memory_bytes)}
        return {**memory.wire(), "model": _model_wire(shape, label), "layout": layout.wire(), **extra}

    def view() -> RenderableType:
        parts: list[RenderableType] = [_model_line(shape, label), Text(f"layout: {layout.describe()}", style="dim"),
                                       _table("memory per device", memory_rows(memory))]
        if target is not None:
            parts.append(_verdict(memory, target))
        return Group(*parts)

    _emit(as_json, data, view)


@plan_app.command("compute")
def compute_command(
    tokens: Annotated[float, typer.Option("--tokens", min=1, help="training tokens (1e12)")],
    model: ModelOpt = None, params: ParamsOpt = None, seq_len: SeqLenOpt = None, vocab: VocabOpt = 32_000,
    devices: Annotated[int, typer.Option("--devices", min=1, rich_help_panel="Devices")] = 1,
    device: DeviceOpt = "h100-80gb", peak_tflops: PeakOpt = None,
    mfu: Annotated[float, typer.Option("--mfu", min=0.001, max=1.0, help="model FLOPs utilisation; 1 when "
                                       "--peak-tflops is already the sustained rate")] = 0.4,
    flops_counted: Annotated[FlopsCount, typer.Option(
        "--flops", help="what --peak-tflops x --mfu counts: model FLOPs (6N + 12·L·H·Q·T per token, PaLM's: what "
                        "every MFU in trainyard divides) or hardware FLOPs (recomputation included, as "
                        "Megatron-LM's achieved TFLOP/s)")] = FlopsCount.MODEL,
    recompute: Annotated[Recompute, typer.Option(
        "--recompute", help="activation recomputation the hardware FLOPs include (full: 8·N·D)")] = Recompute.NONE,
    as_json: JsonOpt = False,
) -> None:
    """Training FLOPs (6·N·D, model FLOPs with attention, hardware), and days to train.

    MFU divides model FLOPs: 6N + 12·L·H·Q·T per token (PaLM's; the same
    count every MFU in trainyard uses). The seed's 6 x 70e9 x 1e12 =
    4.2e23 FLOPs are 4.4e23 with attention at 2,048 tokens, about 66 days
    on 256 devices sustaining 300 TFLOP/s:

        trainyard plan compute --params 70e9 --tokens 1e12 --devices 256
        --peak-tflops 300 --mfu 1

    A published rate that counts full recomputation (Megatron-LM: GPT-3
    175B at 140 TFLOP/s on 1024 A100s, ~34 days for 300B tokens):

        trainyard plan compute --params 175e9 --tokens 300e9 --devices 1024
        --peak-tflops 140 --mfu 1 --flops hardware --recompute full
    """
    shape, label = resolve_model(model, params, seq_len, vocab)
    peak = peak_tflops * 1e12 if peak_tflops else device_option(device).peak_flops
    flops = training_flops(shape.parameters, tokens)
    model_flops = model_flops_per_token(shape) * tokens
    hardware = hardware_training_flops(shape, tokens, recompute)
    counted = hardware if flops_counted is FlopsCount.HARDWARE else model_flops
    time = _build("compute", lambda: training_time(counted, devices=devices, peak_flops_per_device=peak, mfu=mfu,
                                                   counts=flops_counted))

    def data() -> dict[str, Any]:
        return {"model": _model_wire(shape, label), "tokens": tokens, "trainingFlops": flops,
                "modelFlops": model_flops, "hardwareFlops": hardware,
                "modelFlopsPerToken": model_flops_per_token(shape),
                "hardwareFlopsPerToken": hardware_flops_per_token(shape, recompute),
                "attentionFlopsPerToken": attention_flops_per_token(shape), "recompute": recompute.value,
                "flopsCounted": flops_counted.value, "trainingTime": time.wire()}

    def view() -> RenderableType:
        rate = "MFU" if flops_counted is FlopsCount.MODEL else "hardware utilisation"
        return Group(_model_line(shape, label), _table("compute", [
            ("6·N·D (without attention)", f"{flops:.3g}"),
            ("model FLOPs (6N + 12·L·H·Q·T per token: what MFU divides)", f"{model_flops:.3g}"),
            (f"hardware FLOPs (recompute {recompute.value})", f"{hardware:.3g}"),
            (f"devices x peak x {rate}", f"{devices} x {peak / 1e12:.4g} TFLOP/s x {mfu:.0%}"),
            (f"time to train ({flops_counted.value} FLOPs)", f"{time.days:.1f} days ({time.seconds:.3g} s)"),
        ]))

    _emit(as_json, data, view)


@plan_app.command("comm")
def comm_command(
    model: ModelOpt = None, params: ParamsOpt = None, seq_len: SeqLenOpt = None, vocab: VocabOpt = 32_000,
    precision: PrecisionOpt = "mixed",
    dp: DpOpt = 1, tp: TpOpt = 1, pp: PpOpt = 1, zero_stage: ZeroOpt = 0, micro_batch: MicroOpt = 1,
    microbatches: MicrobatchesOpt = 1, sequence_parallel: SeqParOpt = False, recompute: RecomputeOpt = Recompute.NONE,
    schedule: ScheduleOpt = Schedule.ONE_F_ONE_B, virtual_stages: VirtualOpt = 1,
    device: DeviceOpt = "h100-80gb", peak_tflops: PeakOpt = None, memory_gb: MemoryOpt = None,
    devices_per_node: PerNodeOpt = None, nodes_per_rack: PerRackOpt = 4, nvlink_bandwidth: NvlinkOpt = None,
    network_bandwidth: NetworkOpt = None, cross_rack_bandwidth: CrossRackOpt = None,
    efficiency: EfficiencyOpt = None, dp_overlap: OverlapOpt = None,
    headroom: HeadroomOpt = DEFAULT_HEADROOM, as_json: JsonOpt = False,
) -> None:
    """Communication per step against compute, and where the bottleneck sits.

    DP all-reduce, or ZeRO reduce-scatter + all-gather; TP all-reduces per
    layer; PP sends; each over the slowest link its group crosses. Lower the
    network bandwidth and watch the bottleneck move to the interconnect:

        trainyard plan comm --model gpt-1b@v1 --dp 64 --zero-stage 3
        --micro-batch 4 --network-bandwidth 5
    """
    shape, label = resolve_model(model, params, seq_len, vocab)
    layout = resolve_layout(dp=dp, tp=tp, pp=pp, zero_stage=ZeroStage(zero_stage), micro_batch=micro_batch,
                            microbatches=microbatches, sequence_parallel=sequence_parallel, recompute=recompute,
                            schedule=schedule, virtual_stages=virtual_stages)
    target = device_option(device, peak_tflops, memory_gb)
    topology = resolve_topology(target, devices_per_node, nodes_per_rack, nvlink_bandwidth, network_bandwidth,
                                cross_rack_bandwidth)
    step = _build("comm", lambda: estimate_step(
        shape, layout, target, topology, efficiency=efficiency, dp_overlap=dp_overlap,
        bytes_per_parameter=resolve_precision(precision), headroom=headroom))
    _emit(as_json, lambda: {**step.wire(), "model": _model_wire(shape, label), "topology": topology.wire()},
          lambda: Group(_model_line(shape, label), _comm_table(step), _table("step", _step_rows(step)),
                        _verdict(step.memory, target)))


def _comm_table(step: StepEstimate) -> Table:
    c = step.comm
    table = Table(title=f"communication per step per device ({step.layout.describe()})", title_justify="left")
    for column in ("kind", "bytes sent", "time", "link"):
        table.add_column(column, justify="left" if column in ("kind", "link") else "right")
    for kind, sent, seconds, tier in (("data parallel", c.dp_bytes, c.dp_seconds, c.dp_tier),
                                      ("tensor parallel", c.tp_bytes, c.tp_seconds, c.tp_tier),
                                      ("pipeline", c.pp_bytes, c.pp_seconds, c.pp_tier)):
        table.add_row(kind, fmt_bytes(sent), fmt_seconds(seconds) if seconds else "-",
                      tier.value if tier else "-")
    return table


def _step_rows(step: StepEstimate) -> list[tuple[str, str]]:
    return [
        ("compute", fmt_seconds(step.compute_seconds)),
        ("pipeline bubble", f"{fmt_seconds(step.bubble_seconds)} ({step.bubble_ratio:.1%} of compute)"),
        ("exposed communication", fmt_seconds(step.exposed_comm_seconds)),
        ("step", fmt_seconds(step.step_seconds)),
        ("tokens / s (whole job)", fmt_count(step.tokens_per_second)),
        ("MFU", f"{step.mfu:.1%}"),
        ("communication / compute", f"{step.comm_to_compute_ratio:.2f}"),
        ("bottleneck", step.bottleneck.value),
    ]


@plan_app.command("bubble")
def bubble_command(
    pp: Annotated[int, typer.Option("--pp", min=1, help="pipeline stages")],
    microbatches: Annotated[int, typer.Option("--microbatches", min=1, help="micro-batches per step")],
    virtual_stages: VirtualOpt = 1, as_json: JsonOpt = False,
) -> None:
    """Pipeline bubble of GPipe, 1F1B and interleaved: (p-1)/m, or (p-1)/(v·m).

        trainyard plan bubble --pp 8 --microbatches 32 --virtual-stages 4
    """
    rows = [{
        "schedule": s.value,
        "bubbleRatio": _build("bubble", functools.partial(bubble_ratio, s, pp, microbatches, virtual_stages)),
        "bubbleFraction": bubble_fraction(s, pp, microbatches, virtual_stages),
        "inflightMicrobatches": inflight_microbatches(s, pp, microbatches),
    } for s in Schedule]

    def view() -> RenderableType:
        table = Table(title=f"pipeline bubble — {pp} stages, {microbatches} micro-batches, "
                            f"{virtual_stages} chunks per device (interleaved)", title_justify="left")
        for column in ("schedule", "bubble / compute", "share of step idle", "micro-batches held (first stage)"):
            table.add_column(column, justify="left" if column == "schedule" else "right")
        for r in rows:
            table.add_row(str(r["schedule"]), f"{r['bubbleRatio']:.3f}", f"{r['bubbleFraction']:.1%}",
                          str(r["inflightMicrobatches"]))
        return table

    _emit(as_json, lambda: {"stages": pp, "microbatches": microbatches, "virtualStages": virtual_stages,
                            "schedules": rows}, view)


@plan_app.command("checkpoint")
def checkpoint_command(
    model: ModelOpt = None, params: ParamsOpt = None, seq_len: SeqLenOpt = None, vocab: VocabOpt = 32_000,
    precision: PrecisionOpt = "mixed",
    size_gb: Annotated[float | None, typer.Option("--size-gb", min=0.0, show_default=False,
                                                  help="checkpoint size instead of a model's (GB)")] = None,
    write_bandwidth: Annotated[float, typer.Option("--write-bandwidth", min=0.001,
                                                   help="GB/s the whole job writes at")] = 10.0,
    devices: Annotated[int, typer.Option("--devices", min=1, help="devices in the job (its MTBF)")] = 1,
    mtbf_hours: Annotated[float | None, typer.Option("--mtbf-hours", min=0.001, show_default=False,
                                                     help="the whole job's MTBF")] = None,
    device_mtbf_hours: Annotated[float, typer.Option(
        "--device-mtbf-hours", min=0.001, help="one device's MTBF (Llama 3 saw ~50,000 h per H100); "
                                               "job MTBF = this / --devices")] = DEFAULT_DEVICE_MTBF_HOURS,
    keep_last: Annotated[int, typer.Option("--keep-last", min=1, help="checkpoints kept per job")] = 3,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="jobs sharing the storage")] = 1,
    interval_minutes: Annotated[float | None, typer.Option(
        "--interval-minutes", min=0.001, show_default=False, help="evaluate this interval (default: Daly's)")] = None,
    restart_minutes: Annotated[float, typer.Option("--restart-minutes", min=0.0, help="time to restart")] = 0.0,
    step_seconds: Annotated[float | None, typer.Option("--step-seconds", min=0.0001, show_default=False,
                                                       help="say the interval in steps")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Checkpoint size, write stall, storage, Young and Daly intervals, work wasted.

    The seed's: 1 TB at 10 GB/s stalls 100 s; a job on 1024 devices fails
    every ~49 h (50,000 h per device), so checkpoint about every 98 min
    (Young: √(2 x 100 s x 49 h); Daly's refinement 97.7 min):

        trainyard plan checkpoint --size-gb 1000 --write-bandwidth 10
        --devices 1024
    """
    if size_gb is None:
        shape, _ = resolve_model(model, params, seq_len, vocab)
        size = checkpoint_bytes(shape.parameters, resolve_precision(precision))
    else:
        size = size_gb * GB
    mtbf = mtbf_hours * 3600 if mtbf_hours else job_mtbf(device_mtbf_hours * 3600, devices)
    result = _build("checkpoint", lambda: plan_checkpoint(
        size, write_bandwidth=write_bandwidth * GB, mtbf_seconds=mtbf, keep_last=keep_last, jobs=jobs,
        interval_seconds=interval_minutes and interval_minutes * 60, restart_seconds=restart_minutes * 60,
        step_seconds=step_seconds))

    def view() -> RenderableType:
        r = result
        rows = [
            ("size", fmt_bytes(r.size_bytes)),
            ("write stall", fmt_seconds(r.write_seconds)),
            (f"storage ({keep_last} kept x {jobs} jobs)", fmt_bytes(r.storage_bytes)),
            ("job MTBF", fmt_seconds(r.mtbf_seconds)),
            ("Young interval √(2δM)", fmt_seconds(r.young_interval_seconds)),
            ("Daly interval", fmt_seconds(r.daly_interval_seconds)),
            ("interval evaluated", fmt_seconds(r.interval_seconds)
             + (f" ({r.interval_steps} steps)" if r.interval_steps else "")),
            ("work wasted at it (Daly)", f"{r.daly_wasted_fraction:.2%}"),
            ("work wasted at Daly's optimum", f"{r.recommended_wasted_fraction:.2%}"),
        ]
        return _table("checkpoint", rows)

    _emit(as_json, result.wire, view)


@plan_app.command("recommend")
def recommend_command(
    global_batch: Annotated[int, typer.Option("--global-batch", min=1, help="sequences per optimizer step")],
    model: ModelOpt = None, params: ParamsOpt = None, seq_len: SeqLenOpt = None, vocab: VocabOpt = 32_000,
    precision: PrecisionOpt = "mixed",
    device: DeviceOpt = "h100-80gb", devices: Annotated[int, typer.Option(
        "--devices", min=1, rich_help_panel="Devices", help="devices to lay the model out on")] = 8,
    peak_tflops: PeakOpt = None, memory_gb: MemoryOpt = None,
    devices_per_node: PerNodeOpt = None, nodes_per_rack: PerRackOpt = 4, nvlink_bandwidth: NvlinkOpt = None,
    network_bandwidth: NetworkOpt = None, cross_rack_bandwidth: CrossRackOpt = None,
    micro_batches: Annotated[str, typer.Option("--micro-batches", help="micro-batch sizes to try")] = "1,2,4,8",
    efficiency: EfficiencyOpt = None, dp_overlap: OverlapOpt = None,
    headroom: HeadroomOpt = DEFAULT_HEADROOM,
    top: Annotated[int, typer.Option("--top", min=1, help="feasible layouts to show")] = 10,
    rejected: Annotated[int, typer.Option("--rejected", min=0, help="rejected layouts to show, simplest first")] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Feasible layouts ranked by step time, and why the others fail.

    Enumerates dp x tp x pp, ZeRO stage, micro-batch and recomputation; a
    rejected layout says why ("needs 93.1 GB per device, 80 GB available"):

        trainyard plan recommend --params 70e9 --device h100-80gb
        --devices 256 --global-batch 1024
    """
    shape, label = resolve_model(model, params, seq_len, vocab)
    target = device_option(device, peak_tflops, memory_gb)
    topology = resolve_topology(target, devices_per_node, nodes_per_rack, nvlink_bandwidth, network_bandwidth,
                                cross_rack_bandwidth)
    sizes = _build("--micro-batches", lambda: [int(x) for x in micro_batches.split(",") if x.strip()])
    if not sizes or min(sizes) < 1:
        _fail(f"--micro-batches must list positive sizes, e.g. 1,2,4,8 (got {micro_batches!r})")
    found = _build("recommend", lambda: recommend(
        shape, target, devices, global_batch, topology=topology, micro_batches=sizes, efficiency=efficiency,
        dp_overlap=dp_overlap, bytes_per_parameter=resolve_precision(precision), headroom=headroom))

    def data() -> dict[str, Any]:
        return {"model": _model_wire(shape, label), "device": target.wire(), "devices": devices,
                "globalBatch": global_batch, "acceptedCount": len(found.accepted),
                "rejectedCount": len(found.rejected), "accepted": [e.wire() for e in found.accepted[:top]],
                "rejected": [r.wire() for r in found.rejected[:rejected]]}

    def view() -> RenderableType:
        title = (f"{len(found.accepted)} feasible layouts on {devices} x {target.name}, global batch "
                 f"{global_batch}, fastest first\n(layout: dp×tp×pp — sp sequence parallel, c context parallel, "
                 "i interleaved chunks — ZeRO stage, micro-batch × micro-batches, recomputation)")
        parts: list[RenderableType] = [_model_line(shape, label), _accepted_table(title, found.accepted[:top])]
        if rejected and found.rejected:
            parts.append(_rejected_table(found.rejected, rejected))
        return Group(*parts)

    _emit(as_json, data, view)


def _accepted_table(title: str, accepted: Sequence[StepEstimate]) -> Table:
    """The feasible layouts, one row each: memory, step time, MFU, communication against compute, bottleneck."""
    best = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("layout", "memory", "step", "MFU", "comm/comp", "bottleneck"):
        best.add_column(column, justify="left" if column in ("layout", "bottleneck") else "right", no_wrap=True)
    for e in accepted:
        best.add_row(short_layout(e.layout), fmt_bytes(e.memory.required_bytes_per_device),
                     fmt_seconds(e.step_seconds), f"{e.mfu:.1%}", f"{e.comm_to_compute_ratio:.2f}",
                     e.bottleneck.value)
    return best


def _rejected_table(rejected: Sequence[RejectedLayout], shown: int) -> Table:
    """The first ``shown`` rejected layouts and why each does not fit."""
    why = Table(title=f"{len(rejected)} rejected (first {min(shown, len(rejected))})",
                title_justify="left", box=box.SIMPLE_HEAD)
    why.add_column("layout", no_wrap=True)
    why.add_column("why not")
    for r in rejected[:shown]:
        why.add_row(short_layout(r.candidate), "; ".join(r.reasons))
    return why


# ----------------------------------------------------------------------------- calibration (the API)

KIND_TITLES = {"step_time": "step time", "checkpoint_write": "checkpoint stall",
               "failure_interval": "failure interval"}


@contextmanager
def _api(ctx: typer.Context) -> Iterator[ApiClient]:
    """A client from the global --api-url / --token (or the stack's files); see session.py."""
    config = ctx.find_object(CliConfig) or CliConfig(api_url=resolve_api_url(None, Path.cwd()),
                                                     token=resolve_token(None, Path.cwd()))
    with api_session(config) as client:
        yield client


@plan_app.command("calibration")
def calibration_command(
    ctx: typer.Context,
    device: Annotated[str | None, typer.Option("--device", show_default=False,
                                               help="only this device type (cpu, h100-80gb, …)")] = None,
    limit: Annotated[int, typer.Option("--limit", min=0, max=1000,
                                       help="rows per device type and kind, newest first")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="print the API's JSON instead of tables")] = False,
) -> None:
    """What the platform measured against what the planner predicted, per device type.

    Unlike the other plan commands this asks the API (--api-url, --token): the
    fitted factors (measured / predicted step time and checkpoint write time),
    the measured MTBF, and the newest samples, each with the raw and the
    calibrated prediction. POST /v1/plan applies the same factors.

        trainyard plan calibration --device cpu
    """
    params: dict[str, Any] = {"limit": limit}
    if device:
        params["deviceType"] = device
    with _api(ctx) as client:
        data = client.get_json("/v1/plan/calibration", params=params)
    _emit(as_json, lambda: data, lambda: calibration_view(data))


def calibration_view(data: dict[str, Any]) -> RenderableType:
    """Per device type: the factors, then predicted vs measured per kind."""
    fitted = data.get("fittedAt")
    parts: list[RenderableType] = [Text(
        f"fitted {fitted or 'never (no refit yet)'}; a kind needs {data.get('minSamples')} samples, the newest "
        f"{data.get('maxSamples')} are kept", style="dim")]
    if not data.get("devices"):
        parts.append(Text("nothing measured yet: samples come from running jobs' step metrics and failed attempts"))
    for device in data.get("devices", []):
        parts.append(_factors_table(device))
        for kind in device.get("kinds", []):
            if kind.get("rows"):
                parts.append(_rows_table(device["deviceType"], kind))
    return Group(*parts)


def _factors_table(device: dict[str, Any]) -> Table:
    table = Table(title=f"{device['deviceType']}: calibration", title_justify="left", box=box.SIMPLE_HEAD,
                  caption="factor = measured / predicted; mean |error|: raw → calibrated predictions; a failure "
                          "interval counts its duration x its devices",
                  caption_justify="left")
    for column in ("kind", "fitted/kept", "factor", "mean |error|", "implies"):
        table.add_column(column, justify="left" if column in ("kind", "implies") else "right",
                         no_wrap=column != "implies")
    for kind in device.get("kinds", []):
        name = kind["kind"]
        if name == "failure_interval":
            mtbf = kind.get("mtbfSeconds")
            factor, implies = "", f"MTBF {fmt_seconds(mtbf)} per device" if mtbf else "-"
        else:
            factor = f"x {kind['factor']:.3g}" if kind.get("factor") is not None and kind["fittedSamples"] else "-"
            implies = "-"
            if kind["fittedSamples"] and name == "step_time" and device.get("effectiveEfficiency") is not None:
                implies = f"{device['effectiveEfficiency']:.0%} of assumed peak"
            elif kind["fittedSamples"] and name == "checkpoint_write" and device.get("effectiveWriteBandwidth"):
                implies = f"{fmt_bytes(device['effectiveWriteBandwidth'])}/s"
        errors = "-"
        if kind.get("meanAbsErrorPct") is not None:
            errors = f"{kind['meanAbsErrorPct']:.0f} % → {kind['calibratedMeanAbsErrorPct']:.0f} %"
        table.add_row(KIND_TITLES.get(name, name), f"{kind['fittedSamples']}/{kind['storedSamples']}", factor,
                      errors, implies)
    return table


def _rows_table(device_type: str, kind: dict[str, Any]) -> Table:
    table = Table(title=f"{device_type}: {KIND_TITLES.get(kind['kind'], kind['kind'])}, predicted vs measured "
                        f"(newest {len(kind['rows'])} of {kind['storedSamples']})",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("job", "step", "measured", "predicted", "error", "calibrated", "error "):
        table.add_column(column, justify="left" if column == "job" else "right", no_wrap=column != "job")
    for row in kind["rows"]:
        job = row.get("jobId") or "another tenant"
        if row.get("attempt") is not None:
            job += f" #{row['attempt']}"
        step = str(row["step"]) if row.get("step") is not None else "-"
        table.add_row(job, step, fmt_seconds(row["measured"]), fmt_seconds(row["predicted"]),
                      f"{row['errorPct']:+.0f} %", fmt_seconds(row["calibrated"]),
                      f"{row['calibratedErrorPct']:+.0f} %")
    return table
