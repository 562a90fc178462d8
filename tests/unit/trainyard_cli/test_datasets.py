"""``trainyard datasets import`` and ``get`` against a fake API: the tenant's prefix, the command's own help,
publishing and the registry's verdict (the real API and registry: tests/integration/test_registry_datasets.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from trainyard_cli.main import app
from trainyard_contract.storage import ArtifactLayout
from trainyard_trainer.data_cli import main as data_main

Answer = Callable[[httpx.Request], httpx.Response]
SHA = "5" * 64


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.chdir(tmp_path)  # no .trainyard/ here
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.delenv("TRAINYARD_API_URL", raising=False)
    return CliRunner()


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], Answer]:
    """A fake API behind the commands' client: (method, path) -> a function of the request; the caller's
    tenant is acme unless a test answers GET /v1/datasets itself."""
    from trainyard_cli import session as session_module
    from trainyard_cli.client import ApiClient

    answers: dict[tuple[str, str], Answer] = {
        ("GET", "/v1/datasets"): lambda _: httpx.Response(200, json={"tenant": "acme", "datasets": []}),
    }

    def answer(request: httpx.Request) -> httpx.Response:
        handler = answers.get((request.method, request.url.path))
        return handler(request) if handler else httpx.Response(404, json={"detail": "no such path"})

    monkeypatch.setattr(session_module, "ApiClient",
                        lambda url, token: ApiClient(url, token, transport=httpx.MockTransport(answer)))
    return answers


def corpus(tmp_path: Path, text: str = "hello world") -> str:
    path = tmp_path / f"c-{abs(hash(text))}.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": text + " again"}) + "\n")
    return str(path)


def import_args(root: Path, version: str = "v1") -> list[str]:
    return ["--token", "t", "datasets", "import", "--name", "c", "--version", version, "--artifact-root", str(root),
            "--workers", "1", "--vocab-size", "260", "--no-progress"]


def test_datasets_import_help_is_its_own(runner: CliRunner) -> None:
    result = runner.invoke(app, ["datasets", "import", "--help"])
    assert result.exit_code == 0, result.output
    assert "usage: trainyard datasets import" in result.output and "usage: trainyard-data" not in result.output
    for option in ("--publish", "--share TENANT", "--no-wait", "--tokenizer", "--skip-bad", "your token's tenant"):
        assert option in result.output, option


def test_a_tenant_users_import_without_publish_stays_under_its_tenant(
    runner: CliRunner, api: dict[tuple[str, str], Answer], tmp_path: Path,
) -> None:
    root = tmp_path / "artifacts"
    layout = ArtifactLayout(root)
    result = runner.invoke(app, [*import_args(root), corpus(tmp_path)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    mine = layout.dataset_dir("c", "v1", "acme") / "manifest.json"
    assert summary["manifestUri"] == mine.as_uri() and summary["documents"] == 2
    assert not (root / "datasets").exists()  # nothing under the platform's prefix

    # a platform import of the same name@version, from other data, afterwards: no collision
    assert data_main(["import", "--name", "c", "--version", "v1", "--artifact-root", str(root), "--workers", "1",
                      "--vocab-size", "260", "--no-progress", corpus(tmp_path, "other text")]) == 0
    assert (layout.dataset_dir("c", "v1") / "manifest.json").is_file() and mine.is_file()
    assert (layout.dataset_dir("c", "v1") / "manifest.json").read_bytes() != mine.read_bytes()


def test_a_failed_import_is_a_data_error_and_leaves_nothing(
    runner: CliRunner, api: dict[tuple[str, str], Answer], tmp_path: Path,
) -> None:
    root = tmp_path / "artifacts"
    result = runner.invoke(app, [*import_args(root), str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 5 and "missing.jsonl" in result.output
    assert not (root / "tenants").exists()


def test_publishing_options_need_publish_and_a_token_without_tenant_is_refused(
    runner: CliRunner, api: dict[tuple[str, str], Answer], tmp_path: Path,
) -> None:
    result = runner.invoke(app, [*import_args(tmp_path), "--share", "b", corpus(tmp_path)])
    assert result.exit_code == 2 and "--share and --no-wait go with --publish" in result.output
    api[("GET", "/v1/datasets")] = lambda _: httpx.Response(200, json={"tenant": None, "datasets": []})
    result = runner.invoke(app, [*import_args(tmp_path), corpus(tmp_path)])
    assert result.exit_code == 2 and "no tenant" in result.output and "trainyard-data import" in result.output
    assert not (tmp_path / "datasets").exists()


def view(state: str, sha256: str, **fields: object) -> dict[str, object]:
    return {"name": "c", "version": "v1", "tenant": "acme", "sharedWith": [], "sha256": sha256,
            "manifestUri": "file:///a/tenants/acme/datasets/c/v1/manifest.json", "state": state,
            "publishedAt": "2026-01-02T03:04:05Z", **fields}


def publishing(api: dict[tuple[str, str], Answer], verdict: Callable[[str], dict[str, object]]) -> list[str]:
    """POST answers 202; GET …?sha256= answers 404 (undecided) once, then ``verdict(sha256)``. Returns the
    sha256s asked about."""
    asked: list[str] = []

    def get(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params["sha256"])
        if len(asked) == 1:
            return httpx.Response(404, json={"detail": "not verified yet"})
        return httpx.Response(200, json=verdict(asked[-1]))

    api[("POST", "/v1/datasets")] = lambda request: httpx.Response(202, json={
        "dataset": "acme/c@v1", "state": "pending", "manifestUri": json.loads(request.content)["name"]})
    api[("GET", "/v1/datasets/acme/c@v1")] = get
    return asked


def test_publish_waits_for_the_registrys_verdict_and_shows_a_rejection(
    runner: CliRunner, api: dict[tuple[str, str], Answer], tmp_path: Path,
) -> None:
    reason = "dataset acme/c@v1 was already published with sha256 " + "1" * 64 + "; a re-publish … is refused"
    asked = publishing(api, lambda sha: view("rejected", sha, reason=reason, problems=[reason, "[second] one"]))
    result = runner.invoke(app, [*import_args(tmp_path / "a"), "--publish", corpus(tmp_path)])
    assert result.exit_code == 1, result.output
    summary = json.loads(result.stdout.strip().splitlines()[0])
    assert asked == [summary["sha256"]] * 2  # this publish's content, until decided
    assert f"the registry refused acme/c@v1: {reason}" in result.output and "[second] one" in result.output

    asked = publishing(api, lambda sha: view("verified", sha))
    result = runner.invoke(app, [*import_args(tmp_path / "b"), "--publish", corpus(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "acme/c@v1 is verified" in result.output and len(asked) == 2


def test_publish_without_waiting_and_a_verdict_that_does_not_come(
    runner: CliRunner, api: dict[tuple[str, str], Answer], tmp_path: Path,
) -> None:
    asked = publishing(api, lambda sha: view("verified", sha))
    result = runner.invoke(app, [*import_args(tmp_path / "a"), "--publish", "--no-wait", corpus(tmp_path)])
    assert result.exit_code == 0 and asked == [] and "trainyard datasets get acme/c@v1" in result.output

    from trainyard_cli import datasets
    from trainyard_cli.client import ApiClient

    now = [0.0]
    undecided = ApiClient("http://api", "t", transport=httpx.MockTransport(
        lambda _: httpx.Response(404, json={"detail": "not verified yet"})))
    assert datasets.await_verdict(undecided, "acme/c@v1", SHA, timeout_s=5, clock=lambda: now[0],
                                  sleep=lambda s: now.__setitem__(0, now[0] + s)) is None
    assert 5 <= now[0] < 8


def test_datasets_get_shows_a_refused_re_publish_beside_the_verified_version(
    runner: CliRunner, api: dict[tuple[str, str], Answer],
) -> None:
    refusal = {"sha256": "f" * 64, "manifestUri": "file:///m", "reason": "already published with sha256 " + SHA,
               "problems": [], "rejectedAt": "2026-01-02T03:05:00Z", "publishedEventId": "e1"}
    api[("GET", "/v1/datasets/acme/c@v1")] = lambda _: httpx.Response(200, json=view(
        "verified", SHA, numTokens=1234, rejections=[refusal]))
    result = runner.invoke(app, ["--token", "t", "datasets", "get", "acme/c@v1"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "state        verified" in lines and f"sha256       {SHA}" in lines and "tokens       1,234" in lines
    at = lines.index(f"refused      2026-01-02T03:05:00+00:00: a publish with sha256 {'f' * 64}")
    assert lines[at + 1] == f"             already published with sha256 {SHA}"
    result = runner.invoke(app, ["--token", "t", "datasets", "get", "acme/c@v1", "--json"])
    assert json.loads(result.output)["rejections"][0]["sha256"] == "f" * 64
    result = runner.invoke(app, ["--token", "t", "datasets", "get", "acme/none@v1"])
    assert result.exit_code == 1 and "no such path" in result.output
