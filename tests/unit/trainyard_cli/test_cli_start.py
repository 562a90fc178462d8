"""What starting ``trainyard`` imports: only what the command line needs (the figures: bench/cli_start/run.py).

Each case runs a fresh interpreter under ``-X importtime`` and reads the modules it imported; the
assertions are on that set, never on a duration.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from trainyard_cli import main

NEVER = ("torch", "transformers", "faststream", "aiokafka", "redis", "opentelemetry", "numpy", "trio._core")
"""Not for any command that merely starts, asks for help or talks to the API (httpcore's ``import trio`` is
listed even when it fails: ``trio._core`` says whether trio was loaded)."""
NOT_FOR_HELP = (*NEVER, "httpx", "httpcore", "trainyard_contract.wire", "trainyard_contract.events",
                "trainyard_contract.spec", "trainyard_contract.records", "trainyard_planner", "pydantic_settings",
                "rich.progress", "yaml", "pathspec")
"""Not for ``--help``, nor for importing the command line: the API client and the platform's models."""
ENTRY = "import sys; from trainyard_cli.main import app; sys.exit(app(prog_name='trainyard'))"
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}, "COLUMNS": "80"}


def imported(*argv: str) -> set[str]:
    """The modules a fresh ``python -X importtime …`` imported (``argv`` after the interpreter's options)."""
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=120,
                          env=ENV, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


def loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    """Which of ``names`` (or a submodule of one) are among ``modules``."""
    return sorted(n for n in names if any(m == n or m.startswith(n + ".") for m in modules))


def test_importing_the_command_line_imports_no_client_no_models_no_services() -> None:
    modules = imported("-c", "import trainyard_cli.main")
    assert "trainyard_cli.main" in modules
    assert loaded(modules, NOT_FOR_HELP) == []
    assert loaded(modules, ("pydantic", "rich")) == []  # typer parses options with pydantic, not at import


@pytest.mark.parametrize("argv", [["--help"], ["jobs", "list", "--help"], ["jobs", "--help"], ["submit", "--help"],
                                  ["datasets", "--help"], ["triggers", "create", "--help"]])
def test_help_imports_neither_the_client_nor_the_platform(argv: list[str]) -> None:
    modules = imported("-c", ENTRY, *argv)
    assert "typer.rich_utils" in modules  # it did print help
    assert loaded(modules, NOT_FOR_HELP) == []


def test_a_group_is_imported_only_when_its_command_line_reaches_it() -> None:
    modules = imported("-c", ENTRY, "plan", "memory", "--params", "1e9", "--json")
    assert loaded(modules, ("trainyard_planner",)) == ["trainyard_planner"]
    assert "trainyard_cli.devstack" not in modules and "trainyard_cli.admin" not in modules
    assert loaded(modules, NEVER) == []


def test_a_command_that_asks_the_api_imports_no_service_code() -> None:
    # 127.0.0.1:9 refuses at once: the command starts, builds its client, tries, and says it cannot reach it
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", ENTRY, "--api-url", "http://127.0.0.1:9",
                           "--token", "t", "jobs", "list"], capture_output=True, text=True, timeout=120,
                          env=ENV, check=False)
    assert done.returncode == 1 and "cannot reach the trainyard API" in done.stderr
    modules = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "httpx" in modules and "trainyard_contract.wire" in modules
    assert loaded(modules, NEVER) == []
    # the REST bodies, not the event models and records behind them (trainyard_contract.wirebase)
    assert loaded(modules, ("trainyard_contract.events", "trainyard_contract.records", "trainyard_contract.spec",
                            "trainyard_contract.catalog")) == []


@pytest.mark.parametrize("name", ["models", "dev", "admin", "plan"])
def test_lazy_groups_help_matches_their_apps(name: str) -> None:
    """``trainyard --help`` lists a lazy group with the group's own help, and the group works once reached."""
    entry = main._Trainyard.lazy[name]
    assert entry.help == entry.app().info.help
    result = CliRunner().invoke(main.app, [name, "--help"])
    assert result.exit_code == 0 and "--install-completion" not in result.output  # as add_typer made it
    listing = CliRunner().invoke(main.app, ["--help"])
    assert name in listing.output
