"""`trainyard-api --help` explains the TRAINYARD_* variables."""

from __future__ import annotations

import pytest

from trainyard_api.__main__ import parser


def test_help_lists_every_setting_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for var in ("TRAINYARD_API_HOST", "TRAINYARD_API_PORT", "TRAINYARD_REDIS_URL", "TRAINYARD_KAFKA_BOOTSTRAP",
                "OTEL_EXPORTER_OTLP_ENDPOINT"):
        assert var in text


def test_token_subcommand_needs_a_tenant() -> None:
    args = parser().parse_args(["token", "--tenant", "acme"])
    assert (args.command, args.tenant, args.name) == ("token", "acme", "default")
    assert parser().parse_args([]).command is None  # serve
