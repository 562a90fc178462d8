"""``trainyard plan …``: the planner through the command line, JSON for machines and tables for people."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from trainyard_cli import session as session_module
from trainyard_cli.client import ApiClient
from trainyard_cli.main import app
from trainyard_contract.catalog import MODEL_CATALOG

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)  # no .trainyard/ here: planning needs no API and no token
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    return CliRunner()


def plan_json(runner: CliRunner, *args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_seeds_70b_needs_1_12_tb_of_model_states_at_16_bytes(runner: CliRunner) -> None:
    data = plan_json(runner, "memory", "--params", "70e9", "--dp", "1", "--zero-stage", "0")
    assert data["modelStatesBytesPerDevice"] == pytest.approx(1.12e12, rel=1e-12)
    assert data["modelStatesBytesTotal"] == pytest.approx(70e9 * 16, rel=1e-12)
    assert data["weightsBytesPerDevice"] == 140e9 and data["optimizerBytesPerDevice"] == 840e9
    assert data["model"]["parameters"] == 70e9 and data["layout"]["zeroStage"] == 0
    assert data["requiredBytesPerDevice"] > data["usedBytesPerDevice"] > data["modelStatesBytesPerDevice"]


@pytest.mark.parametrize(("stage", "per_device_bytes"), [
    # Rajbhandari et al. 2019, Figure 1: Psi = 7.5B, Nd = 64, K = 12 → 120 / 31.4 / 16.6 / 1.9 GB
    (0, 120e9), (1, 31.4e9), (2, 16.6e9), (3, 1.88e9),
])
def test_zero_stages_reproduce_the_zero_papers_figure_1(runner: CliRunner, stage: int, per_device_bytes: float) -> None:
    data = plan_json(runner, "memory", "--params", "7.5e9", "--dp", "64", "--zero-stage", str(stage))
    assert data["modelStatesBytesPerDevice"] == pytest.approx(per_device_bytes, rel=0.01)


def test_memory_says_whether_it_fits_a_device(runner: CliRunner) -> None:
    data = plan_json(runner, "memory", "--params", "70e9", "--device", "h100-80gb")
    assert data["fits"] is False and data["deviceMemoryBytes"] == 80e9
    assert data["shortfall"].endswith("GB per device, 80 GB available")
    table = runner.invoke(app, ["plan", "memory", "--model", "gpt-tiny@v1", "--device", "h100"])
    assert table.exit_code == 0 and "fits one h100-80gb" in table.output and "model states" in table.output


def test_the_seeds_compute_and_checkpoint_numbers(runner: CliRunner) -> None:
    compute = plan_json(runner, "compute", "--params", "70e9", "--tokens", "1e12", "--devices", "256",
                        "--peak-tflops", "300", "--mfu", "1")
    assert compute["trainingFlops"] == pytest.approx(4.2e23)  # the seed's 6·N·D
    # MFU divides model FLOPs with attention (6N + 12·L·H·Q·T, 4 % more at 2,048 tokens): 65.9 days, not 63.3
    assert compute["modelFlops"] == pytest.approx(4.375e23, rel=0.001)
    assert compute["trainingTime"]["days"] == pytest.approx(65.9, abs=0.05)
    checkpoint = plan_json(runner, "checkpoint", "--size-gb", "1000", "--write-bandwidth", "10")
    assert checkpoint["writeSeconds"] == pytest.approx(100.0)
    assert checkpoint["storageBytes"] == pytest.approx(3e12)
    # Young: sqrt(2 x 100 s x 50,000 h / 1024 devices)
    young = plan_json(runner, "checkpoint", "--size-gb", "1000", "--devices", "1024")["youngIntervalSeconds"]
    assert young == pytest.approx((2 * 100 * 50_000 * 3600 / 1024) ** 0.5)


def test_compute_says_which_flops_a_published_rate_counts(runner: CliRunner) -> None:
    """Narayanan et al. 2021 §5.1: GPT-3 175B, 300B tokens, 1024 A100s at 140 TFLOP/s is ~34 days,
    because that rate counts full recomputation (8·N·D); read as model FLOPs (the default, attention
    included) it says 26.1 days. Both counts are printed either way."""
    args = ("compute", "--params", "175e9", "--tokens", "300e9", "--devices", "1024", "--peak-tflops", "140",
            "--mfu", "1")
    model = plan_json(runner, *args)
    assert model["flopsCounted"] == "model" and model["trainingTime"]["counts"] == "model"
    assert model["trainingTime"]["days"] == pytest.approx(26.1, abs=0.05)
    hardware = plan_json(runner, *args, "--flops", "hardware", "--recompute", "full")
    assert hardware["trainingTime"]["counts"] == "hardware" and hardware["recompute"] == "full"
    assert hardware["trainingTime"]["days"] == pytest.approx(34, rel=0.03)
    assert hardware["hardwareFlops"] == pytest.approx(8 / 6 * hardware["modelFlops"], rel=0.01)
    assert hardware["trainingFlops"] == model["trainingFlops"] == pytest.approx(6 * 175e9 * 300e9)
    table = runner.invoke(app, ["plan", *args, "--flops", "hardware", "--recompute", "full"])
    assert table.exit_code == 0, table.output
    assert "6·N·D (without attention)" in table.output and "hardware FLOPs (recompute full)" in table.output
    assert "time to train (hardware FLOPs)" in table.output


def test_bubble_compares_the_three_schedules(runner: CliRunner) -> None:
    data = plan_json(runner, "bubble", "--pp", "4", "--microbatches", "8", "--virtual-stages", "2")
    by_name = {row["schedule"]: row for row in data["schedules"]}
    assert by_name["gpipe"]["bubbleRatio"] == by_name["1f1b"]["bubbleRatio"] == pytest.approx(3 / 8)
    assert by_name["interleaved"]["bubbleRatio"] == pytest.approx(3 / 16)
    assert by_name["gpipe"]["inflightMicrobatches"] == 8 and by_name["1f1b"]["inflightMicrobatches"] == 4


def test_comm_reports_the_bottleneck_moving_to_the_interconnect(runner: CliRunner) -> None:
    args = ["comm", "--model", "gpt-1b@v1", "--dp", "64", "--zero-stage", "3", "--micro-batch", "4"]
    fast = plan_json(runner, *args, "--network-bandwidth", "400")
    slow = plan_json(runner, *args, "--network-bandwidth", "1")
    assert fast["bottleneck"] == "compute" and slow["bottleneck"] == "interconnect"
    assert slow["comm"]["dpBytes"] == fast["comm"]["dpBytes"] > 0 and slow["comm"]["dpTier"] == "cross_rack"


def test_recommend_ranks_layouts_and_explains_rejections(runner: CliRunner) -> None:
    data = plan_json(runner, "recommend", "--params", "70e9", "--devices", "64", "--global-batch", "256",
                     "--top", "3", "--rejected", "2")
    assert data["acceptedCount"] > 0 and len(data["accepted"]) == 3
    steps = [a["stepSeconds"] for a in data["accepted"]]
    assert steps == sorted(steps)
    assert all(a["memory"]["requiredBytesPerDevice"] <= 80e9 for a in data["accepted"])
    plain = data["rejected"][0]
    assert plain["candidate"]["dp"] == 64 and plain["candidate"]["zeroStage"] == 0
    assert plain["reasons"][0].startswith("needs ") and plain["reasons"][0].endswith("80 GB available")
    table = runner.invoke(app, ["plan", "recommend", "--model", "gpt-small@v1", "--devices", "2",
                                "--global-batch", "8", "--device", "a100"])
    assert table.exit_code == 0 and "feasible layouts on 2 x a100-80gb" in table.output


def test_a_model_comes_from_the_catalog_a_spec_file_or_inline_json(runner: CliRunner, tmp_path: Path) -> None:
    from_spec = plan_json(runner, "memory", "--model", str(REPO / "examples" / "tiny.yaml"))
    assert from_spec["model"]["seqLen"] == 64 and from_spec["model"]["source"].startswith("gpt-tiny@v1")
    assert from_spec["model"]["parameters"] == MODEL_CATALOG["gpt-tiny@v1"].num_parameters  # positions: maxSeqLen
    inline = '{"vocabSize": 1024, "nLayers": 2, "nHeads": 4, "dModel": 64, "maxSeqLen": 128}'
    assert plan_json(runner, "memory", "--model", inline)["model"]["parameters"] == \
        plan_json(runner, "memory", "--model", "gpt-tiny@v1")["model"]["parameters"]


@pytest.mark.parametrize(("args", "message"), [
    (["memory"], "give a model"),
    (["memory", "--model", "gpt-huge@v9"], "gpt-tiny@v1"),
    (["memory", "--model", "gpt-tiny@v1", "--params", "1e9"], "give a model"),
    (["memory", "--model", '{"vocabSize": 10, "nLayers": 1, "nHeads": 3, "dModel": 8, "maxSeqLen": 4}'],
     "divisible by nHeads"),
    (["memory", "--model", "gpt-tiny@v1", "--seq-len", "4096"], "maxSeqLen 128"),
    (["recommend", "--params", "1e9", "--global-batch", "8", "--device", "tpu-v9"], "--peak-tflops"),
    (["memory", "--params", "1e9", "--precision", "int3"], "--precision"),
    (["recommend", "--params", "1e9", "--global-batch", "8", "--micro-batches", "2,0"], "--micro-batches"),
])
def test_bad_input_is_one_line_and_exit_2(runner: CliRunner, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_help_lists_every_plan_command_with_examples(runner: CliRunner) -> None:
    result = runner.invoke(app, ["plan", "--help"])
    assert result.exit_code == 0
    for command in ("memory", "compute", "comm", "bubble", "checkpoint", "recommend", "calibration"):
        assert command in result.output
    assert "trainyard plan memory --params 70e9" in result.output
    memory_help = runner.invoke(app, ["plan", "memory", "--help"]).output
    assert "--zero-stage" in memory_help and "1.12 TB" in memory_help


# ----------------------------------------------------------------------------- calibration (asks the API)

REPORT = {
    "fittedAt": "2025-03-01T12:00:00Z", "minSamples": 3, "maxSamples": 200,
    "assumptions": {"cpuPeakFlops": 1e10, "writeBandwidth": 5e8, "efficiency": 0.5, "deviceMtbfHours": 50000},
    "devices": [{
        "deviceType": "cpu",
        "factors": {"deviceType": "cpu", "stepTimeFactor": 0.21, "stepTimeSamples": 9, "checkpointWriteFactor": 1.0,
                    "checkpointWriteSamples": 0, "mtbfSeconds": 7200.0, "failureSamples": 3},
        "effectiveEfficiency": 1.0, "effectiveWriteBandwidth": 5e8,
        "kinds": [
            {"kind": "step_time", "unit": "seconds", "storedSamples": 9, "fittedSamples": 9, "factor": 0.21,
             "meanAbsErrorPct": 380.0, "calibratedMeanAbsErrorPct": 2.0,
             "rows": [{"label": "gpt-tiny@v1", "jobId": "job-abc", "attempt": 1, "step": 12,
                       "recordedAt": "2025-03-01T12:00:00Z", "measured": 0.05, "predicted": 0.24, "calibrated": 0.0504,
                       "errorPct": 380.0, "calibratedErrorPct": 0.8},
                      {"label": "another tenant's job (gpt-tiny@v1)", "jobId": None, "attempt": None, "step": 11,
                       "recordedAt": "2025-03-01T12:00:00Z", "measured": 0.051, "predicted": 0.24,
                       "calibrated": 0.0504, "errorPct": 370.6, "calibratedErrorPct": -1.2}]},
            {"kind": "checkpoint_write", "unit": "seconds", "storedSamples": 0, "fittedSamples": 0, "factor": None,
             "meanAbsErrorPct": None, "calibratedMeanAbsErrorPct": None, "rows": []},
            {"kind": "failure_interval", "unit": "device-seconds", "storedSamples": 3, "fittedSamples": 3,
             "mtbfSeconds": 7200.0, "meanAbsErrorPct": 99.0, "calibratedMeanAbsErrorPct": 40.0, "rows": []},
        ],
    }],
}


@pytest.fixture
def api_requests(monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    """``plan calibration`` talks to a fake API that answers REPORT; the requests it saw."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.headers.get("authorization") != "Bearer tok":
            return httpx.Response(401, json={"detail": "unknown token"})
        return httpx.Response(200, json=REPORT if "deviceType" not in request.url.params else {**REPORT, "devices": []})

    monkeypatch.setattr(session_module, "ApiClient",  # every command's client comes from session.api_session
                        lambda url, token: ApiClient(url, token, transport=httpx.MockTransport(answer)))
    return seen


def test_calibration_asks_the_api_and_prints_its_json(runner: CliRunner, api_requests: list[httpx.Request]) -> None:
    result = runner.invoke(app, ["--api-url", "http://api:9", "--token", "tok", "plan", "calibration", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == REPORT
    (request,) = api_requests
    assert request.url.path == "/v1/plan/calibration" and request.url.params["limit"] == "10"
    assert request.url.host == "api"


def test_calibration_tables_show_factors_and_predicted_vs_measured(
    runner: CliRunner, api_requests: list[httpx.Request]
) -> None:
    result = runner.invoke(app, ["--token", "tok", "plan", "calibration"])
    assert result.exit_code == 0, result.output
    for text in ("cpu: calibration", "x 0.21", "9/9", "380 % → 2 %", "MTBF 2 h",
                 "predicted vs measured", "job-abc #1", "another tenant", "+380 %", "50 ms"):
        assert text in result.output, text
    empty = runner.invoke(app, ["--token", "tok", "plan", "calibration", "--device", "a100", "--limit", "3"])
    assert empty.exit_code == 0 and "nothing measured yet" in empty.output
    assert api_requests[-1].url.params["deviceType"] == "a100" and api_requests[-1].url.params["limit"] == "3"


def test_calibration_needs_a_token_and_a_reachable_api(runner: CliRunner, api_requests: list[httpx.Request]) -> None:
    no_token = runner.invoke(app, ["plan", "calibration"])
    assert no_token.exit_code == 2 and "no API token" in no_token.output and not api_requests
    refused = runner.invoke(app, ["--token", "wrong", "plan", "calibration"])
    assert refused.exit_code == 1 and "refused the token" in refused.output
