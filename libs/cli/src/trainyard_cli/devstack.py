"""`trainyard dev …`: the embedded local stack (being written by the lead)."""

from __future__ import annotations

import typer

dev_app = typer.Typer(help="Run the local stack on this host: broker, Redis, services, node agents.")
