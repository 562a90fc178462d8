"""Where the CLI finds the API and its token.

Precedence: the flag (``--api-url`` / ``--token``), then the environment
(``TRAINYARD_API_URL`` / ``TRAINYARD_TOKEN``, handled by typer), then the files the local
stack writes (``.trainyard/api-url``, ``.trainyard/dev-token``, looked up from the working
directory upwards), then the default URL ``http://127.0.0.1:8080`` (no default token).
``trainyard admin …`` commands without a flag or variable use ``.trainyard/admin-token`` (the
platform-admin token the API bootstraps for the local stack) when it exists, else the dev token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard_contract.errors import ConfigError

DEFAULT_API_URL = "http://127.0.0.1:8080"
STATE_DIR = ".trainyard"
API_URL_FILE = "api-url"
TOKEN_FILE = "dev-token"
ADMIN_TOKEN_FILE = "admin-token"

NO_TOKEN = (
    "no API token: pass --token, set TRAINYARD_TOKEN, or run `make up` "
    "(it writes a development token to .trainyard/dev-token)"
)


def find_state_dir(start: Path) -> Path | None:
    """The nearest ``.trainyard/`` directory at or above ``start``."""
    for directory in (start, *start.parents):
        candidate = directory / STATE_DIR
        if candidate.is_dir():
            return candidate
    return None


def _read_first_line(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text.splitlines()[0].strip() if text else None


def resolve_api_url(flag: str | None, start: Path) -> str:
    """``flag`` (already merged with the environment by typer), else the stack's file, else the default."""
    if flag:
        return flag.rstrip("/")
    state = find_state_dir(start)
    from_file = _read_first_line(state / API_URL_FILE) if state else None
    return (from_file or DEFAULT_API_URL).rstrip("/")


def resolve_token(flag: str | None, start: Path) -> str | None:
    if flag:
        return flag.strip()
    state = find_state_dir(start)
    return _read_first_line(state / TOKEN_FILE) if state else None


def resolve_admin_token(flag: str | None, start: Path) -> str | None:
    """``flag``, else the stack's admin token file, else its dev token file."""
    if flag:
        return flag.strip()
    state = find_state_dir(start)
    return (_read_first_line(state / ADMIN_TOKEN_FILE) or _read_first_line(state / TOKEN_FILE)) if state else None


@dataclass
class CliConfig:
    """What the global options resolved to; the token is required only by API commands."""

    api_url: str
    token: str | None
    admin_token: str | None = None

    def require_token(self) -> str:
        if not self.token:
            raise ConfigError(NO_TOKEN)
        return self.token

    def require_admin_token(self) -> str:
        """The token of ``trainyard admin …`` commands (see the module docstring)."""
        token = self.admin_token or self.token
        if not token:
            raise ConfigError("no admin token: pass --token, set TRAINYARD_TOKEN, or run `make up` (the API writes "
                              "a platform-admin token to .trainyard/admin-token)")
        return token


def load_spec(path: Path, stdin_text: str | None = None) -> dict[str, Any]:
    """A spec file as a dict: JSON by ``.json``, YAML otherwise (``-`` reads ``stdin_text``).

    A parse error names the file and where: ``examples/x.yaml, line 3, column 9: mapping values are not
    allowed here`` (``<stdin>`` for ``-``).
    """
    name = "<stdin>" if str(path) == "-" else str(path)
    if str(path) == "-":
        text = stdin_text or ""
    else:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the spec {path}: {exc.strerror or exc}") from exc
    data = _parse_json(text, name) if path.suffix.lower() == ".json" else _parse_yaml(text, name)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{name} must hold a mapping (the training spec), not {type(data).__name__}")
    return dict(data)


def _parse_json(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        what = exc.msg.removesuffix(" at")  # "Invalid control character at": json's message expects its position
        if what.startswith("Invalid control character") and exc.pos < len(text):
            what += f" {text[exc.pos]!r} (write it escaped)"
        raise ConfigError(f"{name}, line {exc.lineno}, column {exc.colno}: {what} (not valid JSON)") from exc


def _parse_yaml(text: str, name: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = "; ".join(part for part in (exc.context, exc.problem) if part) or "cannot be parsed"
        raise ConfigError(f"{name}{where}: {what} (not valid YAML)") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: {exc} (not valid YAML)") from exc
