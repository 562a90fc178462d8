"""`trainyard triggers …`: what list and show print, the default name, and the help."""

from __future__ import annotations

from rich.console import Console
from typer.testing import CliRunner

from trainyard_cli.client import Trigger
from trainyard_cli.main import _trigger_name, app
from trainyard_cli.render import trigger_detail, triggers_table

TRIGGER = Trigger.model_validate({
    "triggerId": "trg-5c1d9e0a7b2f", "tenant": "acme", "name": "wiki", "dataset": "wiki-*",
    "sources": ["own", "shared"], "template": {"modelConfig": "gpt-tiny@v1", "resources": {"gpuType": "cpu",
                                                                                            "gpuCount": 2}},
    "enabled": True, "createdBy": "tok_1", "createdAt": "2026-12-01T10:00:00Z",
    "jobs": [{"dataset": "acme/wiki-en@v1", "jobId": "job-3f2a9c1b7e4d"}],
    "lastFailure": {"at": "2026-12-01T11:00:00Z", "dataset": "acme/wiki-de@v1", "eventId": "e",
                    "message": "the template does not validate with this dataset",
                    "problems": [{"field": "modelConfig", "message": "unknown model 'gpt-tiny@v1'"}]},
})


def render(renderable: object) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_show_prints_what_it_matches_the_jobs_it_started_and_its_last_failure() -> None:
    text = render(trigger_detail(TRIGGER))
    for expected in ("trg-5c1d9e0a7b2f", "wiki-*", "own, shared", "gpt-tiny@v1", "2 x cpu",
                     "acme/wiki-en@v1", "job-3f2a9c1b7e4d", "acme/wiki-de@v1", "modelConfig: unknown model"):
        assert expected in text, expected
    quiet = render(trigger_detail(TRIGGER.model_copy(update={"jobs": [], "last_failure": None})))
    assert "no jobs started yet" in quiet and "last failure" not in quiet


def test_list_prints_a_row_per_trigger_with_its_last_failure() -> None:
    text = render(triggers_table([TRIGGER, TRIGGER.model_copy(update={"trigger_id": "trg-000000000002",
                                                                      "last_failure": None, "enabled": False})]))
    assert "trg-5c1d9e0a7b2f" in text and "trg-000000000002" in text
    assert "acme/wiki-de@v1: the template does not validate" in text


def test_the_default_name_is_the_globs_letters() -> None:
    assert _trigger_name("wiki-*") == "wiki"
    assert _trigger_name("tinycorpus") == "tinycorpus"
    assert _trigger_name("*") == "trigger"


def test_help_lists_the_trigger_commands() -> None:
    result = CliRunner().invoke(app, ["triggers", "--help"])
    assert result.exit_code == 0
    for command in ("create", "list", "show", "delete"):
        assert command in result.output
