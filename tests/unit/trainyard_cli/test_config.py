"""Where the CLI finds the API URL, the token and the spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard_cli.config import DEFAULT_API_URL, CliConfig, load_spec, resolve_api_url, resolve_token
from trainyard_contract.errors import ConfigError


def test_flag_beats_files_and_files_beat_the_default(tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    assert resolve_api_url(None, nested) == DEFAULT_API_URL
    assert resolve_token(None, nested) is None
    state = tmp_path / ".trainyard"
    state.mkdir()
    (state / "api-url").write_text("http://127.0.0.1:9999/\n")
    (state / "dev-token").write_text("ty_dev_abc\n")
    assert resolve_api_url(None, nested) == "http://127.0.0.1:9999"  # found from a subdirectory
    assert resolve_token(None, nested) == "ty_dev_abc"
    assert resolve_api_url("http://api:8080/", nested) == "http://api:8080"
    assert resolve_token("mine", nested) == "mine"


def test_a_missing_token_says_what_to_do() -> None:
    with pytest.raises(ConfigError, match="make up"):
        CliConfig(api_url=DEFAULT_API_URL, token=None).require_token()


def test_specs_load_from_yaml_and_json(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("specVersion: v1\ntraining:\n  maxSteps: 4\n")
    (tmp_path / "s.json").write_text('{"specVersion": "v1"}')
    assert load_spec(tmp_path / "s.yaml") == {"specVersion": "v1", "training": {"maxSteps": 4}}
    assert load_spec(tmp_path / "s.json") == {"specVersion": "v1"}
    assert load_spec(Path("-"), "specVersion: v1") == {"specVersion": "v1"}


@pytest.mark.parametrize(("name", "text", "says"), [
    ("bad.json", "{nope", "not valid JSON"),
    ("bad.yaml", "a: [1,", "not valid YAML"),
    ("list.yaml", "- 1\n- 2\n", "must hold a mapping"),
])
def test_bad_spec_files_are_config_errors(tmp_path: Path, name: str, text: str, says: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=says):
        load_spec(tmp_path / name)
    with pytest.raises(ConfigError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
