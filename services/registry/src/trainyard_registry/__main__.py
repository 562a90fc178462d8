"""``python -m trainyard_registry`` / ``trainyard-registry``."""

from __future__ import annotations

import argparse
import sys
import textwrap

from pydantic_settings import BaseSettings

from trainyard_common.errors import ConfigError
from trainyard_common.service import configure_logging, run_main
from trainyard_common.settings import load_settings

from trainyard_registry.registry import build_service
from trainyard_registry.settings import RegistrySettings

DESCRIPTION = """\
trainyard registry: records every dataset version (trainyard.datasets), every READY
checkpoint (trainyard.checkpoints) and the final model of every succeeded job
(trainyard.jobs) as artifacts with lineage (spec hash, code revision, dataset manifest and
sha256, tokenizer, model config, parent checkpoint, producing attempt, content hash).
The API serves them at GET /v1/registry/artifacts?jobId=. Runs until SIGTERM or SIGINT."""


def settings_help(cls: type[BaseSettings]) -> str:
    """One line per TRAINYARD_* variable: name, default and meaning."""
    prefix = cls.model_config.get("env_prefix", "")
    lines = ["environment variables:"]
    for name, field in cls.model_fields.items():
        default = "" if field.is_required() else f" (default: {field.default})"
        lines.append(f"  {prefix}{name.upper()}{default}")
        if field.description:
            lines.extend(textwrap.wrap(field.description, 76, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="trainyard-registry",
        description=DESCRIPTION,
        epilog=settings_help(RegistrySettings),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Parse the settings once, then serve until SIGTERM."""
    parse_args(argv)
    try:
        settings = load_settings(RegistrySettings)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(settings.log_level, "registry")

    async def serve() -> None:
        await build_service(settings).run()

    run_main(serve)


if __name__ == "__main__":
    main()
