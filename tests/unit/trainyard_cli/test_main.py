"""The command line: parsing, rendering and error messages (no API needed)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from trainyard_cli.main import app
from trainyard_cli.render import checkpoints_table, field_problems, fmt_tokens, jobs_table
from trainyard_contract.wire import CheckpointView, JobSummary


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)  # no .trainyard/ here
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.delenv("TRAINYARD_API_URL", raising=False)
    return CliRunner()


def test_help_lists_the_commands(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("submit", "jobs", "artifacts", "dev"):
        assert command in result.output
    result = runner.invoke(app, ["jobs", "--help"])
    for command in ("list", "get", "cancel", "checkpoints", "follow"):
        assert command in result.output


def test_a_missing_token_is_one_line_saying_make_up(runner: CliRunner) -> None:
    result = runner.invoke(app, ["jobs", "list"])
    assert result.exit_code == 2
    assert "no API token" in result.output and "make up" in result.output


def test_an_unreachable_api_is_one_line_saying_make_up(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--api-url", "http://127.0.0.1:1", "--token", "t", "jobs", "get", "job-1"])
    assert result.exit_code == 1
    assert "cannot reach the trainyard API at http://127.0.0.1:1" in result.output and "make up" in result.output
    assert "Traceback" not in result.output


def test_submit_reports_an_unreadable_spec(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("a: [1,")
    result = runner.invoke(app, ["--token", "t", "submit", "bad.yaml"])
    assert result.exit_code == 2 and "not valid YAML" in result.output
    result = runner.invoke(app, ["--token", "t", "submit", "nope.yaml"])
    assert result.exit_code == 2 and "cannot read the spec" in result.output


def test_artifacts_list_requires_a_job(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--token", "t", "artifacts", "list"])
    assert result.exit_code == 2 and "--job" in result.output


def render(renderable: object) -> str:
    console = Console(record=True, width=250)
    console.print(renderable)
    return console.export_text()


def test_tables_show_the_fields_that_matter() -> None:
    rows = [JobSummary.model_validate({"jobId": "job-0123456789ab", "name": "tiny", "state": "queued",
                                       "specHash": "sha256:x", "model": "gpt-tiny@v1", "dataset": "tinycorpus@v1",
                                       "gpuCount": 64, "attempts": 0, "globalStep": 0, "maxSteps": 40,
                                       "lastLoss": None, "createdAt": "2024-05-01T12:00:00Z",
                                       "updatedAt": "2024-05-01T12:00:00Z", "reason": None,
                                       "queuedReason": "needs 64 devices, cluster has 8"})]
    text = render(jobs_table(rows))
    assert "job-0123456789ab" in text and "0/40" in text and "needs 64 devices" in text
    ckpt = CheckpointView.model_validate({
        "checkpointId": "step-000000020-a1", "state": "READY", "globalStep": 20, "attempt": 1, "worldSize": 2,
        "manifestUri": "file:///m.json", "contentHash": "sha256:abc", "consumedTokens": 40960, "reason": None,
        "createdAt": "2024-05-01T12:00:00Z", "readyAt": "2024-05-01T12:00:03Z"})
    text = render(checkpoints_table([ckpt]))
    assert "step-000000020-a1" in text and "READY" in text and "file:///m.json" in text


def test_field_problems_print_one_line_each() -> None:
    text = render(field_problems([("training.globalBatchSize", "must be a multiple of 16"),
                                  ("dataset", "unknown dataset 'x@v1'")]))
    assert "  training.globalBatchSize: must be a multiple of 16" in text
    assert "  dataset: unknown dataset 'x@v1'" in text


@pytest.mark.parametrize(("n", "text"), [(None, "-"), (999, "999"), (1500, "1.5k"), (3_400_000, "3.4M")])
def test_token_counts_are_short(n: int | None, text: str) -> None:
    assert fmt_tokens(n) == text


# trainyard datasets import / get: tests/unit/trainyard_cli/test_datasets.py


# ----------------------------------------------------------------------------- text, not markup

BRACKETS = "job [bold]x[/bold] refused: ranks [1, 2] disagree [/] [red]"


@pytest.fixture
def api_answers(monkeypatch: pytest.MonkeyPatch) -> dict[str, httpx.Response]:
    """A fake API behind every command's client (session.api_session): path -> the response it gives."""
    from trainyard_cli import session as session_module
    from trainyard_cli.client import ApiClient

    answers: dict[str, httpx.Response] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        return answers.get(request.url.path, httpx.Response(404, json={"detail": "no such path"}))

    monkeypatch.setattr(session_module, "ApiClient",
                        lambda url, token: ApiClient(url, token, transport=httpx.MockTransport(answer)))
    return answers


@pytest.mark.parametrize("status", [400, 404, 409, 503])
def test_an_api_error_prints_as_text_brackets_and_all(runner: CliRunner, api_answers: dict[str, httpx.Response],
                                                      status: int) -> None:
    api_answers["/v1/training-jobs/job-1/cancel"] = httpx.Response(status, json={"detail": BRACKETS})
    result = runner.invoke(app, ["--token", "t", "jobs", "cancel", "job-1"])
    assert result.exit_code == 1, result.output
    assert BRACKETS in result.output and "Traceback" not in result.output


def test_a_refused_spec_prints_each_field_as_text(runner: CliRunner, api_answers: dict[str, httpx.Response],
                                                  tmp_path: Path) -> None:
    api_answers["/v1/training-jobs"] = httpx.Response(422, json={"detail": [
        {"field": "training.schedule[0]", "message": "must be one of [cosine, linear]"}]})
    (tmp_path / "spec.yaml").write_text("name: x\n")
    result = runner.invoke(app, ["--token", "t", "submit", "spec.yaml"])
    assert result.exit_code == 1
    assert "training.schedule[0]: must be one of [cosine, linear]" in result.output


def test_a_server_note_in_a_table_prints_as_text(runner: CliRunner, api_answers: dict[str, httpx.Response]) -> None:
    job = {"jobId": "job-0123456789ab", "name": "[bold]x[/bold]", "state": "failed", "specHash": "sha256:x",
           "model": "gpt-tiny@v1", "dataset": "tinycorpus@v1", "gpuCount": 1, "attempts": 1, "globalStep": 3,
           "maxSteps": 40,
           "lastLoss": None, "createdAt": "2024-05-01T12:00:00Z", "updatedAt": "2024-05-01T12:00:00Z",
           "queuedReason": None, "reason": "rank [1, 2] exited [/]"}
    api_answers["/v1/training-jobs"] = httpx.Response(200, json={"jobs": [job], "nextOffset": None})
    result = runner.invoke(app, ["--token", "t", "jobs", "list"])
    assert result.exit_code == 0, result.output
    assert "[bold]x[/bold]" in result.output and "rank [1, 2] exited [/]" in result.output


@pytest.mark.parametrize(("name", "text", "where", "what"), [
    ("spec.yaml", "name: x\n  bad: [1, 2]\n", "line 2, column 6", "mapping values are not allowed here"),
    ("spec.yaml", "a: [1,\n", "line 2, column 1", "expected the node content"),
    ("spec.json", '{"name": "a\tb"}', "line 1, column 12", "Invalid control character '\\t'"),
    ("spec.json", '{"a": [1, 2}', "line 1, column 12", "Expecting ',' delimiter"),
])
def test_a_broken_spec_file_is_named_with_its_line_and_column(runner: CliRunner, tmp_path: Path, name: str,
                                                              text: str, where: str, what: str) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / name).write_text(text)
    result = runner.invoke(app, ["--token", "t", "submit", f"examples/{name}"])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert f"error: examples/{name}, {where}: " in message and what in message, message
    assert "<unicode string>" not in message


def test_a_broken_spec_on_stdin_is_named_stdin(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--token", "t", "submit", "-"], input="a: [\n")
    assert result.exit_code == 2 and "error: <stdin>, line 2, column 1: " in result.output
