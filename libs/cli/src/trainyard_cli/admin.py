"""`trainyard admin …`: tenant administration against the state store (needs TRAINYARD_REDIS_URL)."""

from __future__ import annotations

import asyncio
import secrets

import typer
from rich.console import Console

from trainyard_common.settings import ServiceSettings, load_settings
from trainyard_common.store import StateStore, connect_redis

admin_app = typer.Typer(
    help="Tenant administration: API tokens. Talks to Redis directly (TRAINYARD_REDIS_URL).",
    no_args_is_help=True,
)
console = Console(stderr=True)


@admin_app.command("create-token")
def create_token(
    tenant: str = typer.Option(..., "--tenant", help="the tenant the token acts for"),
    name: str = typer.Option("default", "--name", help="a label for the token (shown as submittedBy)"),
) -> None:
    """Create an API token for TENANT and print it once (only its sha256 is stored)."""
    settings = load_settings(ServiceSettings)
    token = "ty_" + secrets.token_urlsafe(32)

    async def store() -> None:
        redis = connect_redis(settings.redis_url)
        try:
            await StateStore(redis).add_token(token, tenant, name=name)
        finally:
            await redis.aclose()

    asyncio.run(store())
    console.print(f"token for tenant [bold]{tenant}[/bold] ({name}); it is not shown again:")
    print(token)
