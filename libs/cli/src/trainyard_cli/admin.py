"""`trainyard admin …`: tenant administration against the state store (needs TRAINYARD_REDIS_URL)."""

from __future__ import annotations

import asyncio
import secrets

import typer
from rich.console import Console

from trainyard_common.settings import ServiceSettings, load_settings
from trainyard_common.store import StateStore, connect_redis

admin_app = typer.Typer(
    help="Administration: API tokens (Redis directly, TRAINYARD_REDIS_URL); nodes (the API, admin token).",
    no_args_is_help=True,
)
nodes_app = typer.Typer(help="Nodes: inventory, quarantine, reputation; reinstate, drain, undrain (needs an admin "
                             "token).",
                        no_args_is_help=True)
admin_app.add_typer(nodes_app, name="nodes")
console = Console(stderr=True)


@admin_app.command("create-token")
def create_token(
    tenant: str = typer.Option(..., "--tenant", help="the tenant the token acts for"),
    name: str = typer.Option("default", "--name", help="a label for the token (shown as submittedBy)"),
    admin: bool = typer.Option(False, "--admin", help="an admin token: /v1/admin routes and every tenant's goodput"),
) -> None:
    """Create an API token for TENANT and print it once (only its sha256 is stored)."""
    settings = load_settings(ServiceSettings)
    token = "ty_" + secrets.token_urlsafe(32)

    async def store() -> None:
        redis = connect_redis(settings.redis_url)
        try:
            await StateStore(redis).add_token(token, tenant, name=name, admin=admin)
        finally:
            await redis.aclose()

    asyncio.run(store())
    console.print(f"token for tenant [bold]{tenant}[/bold] ({name}); it is not shown again:")
    print(token)


@nodes_app.command("list")
def nodes_list(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="print the API's JSON")) -> None:
    """Every node: devices, health, quarantine (reason, by) and reputation score."""
    from trainyard_cli.main import _api, _print_json, out
    from trainyard_cli.render import nodes_table

    with _api(ctx) as client:
        body = client.get_json("/v1/admin/nodes")
    if as_json:
        _print_json(body)
    else:
        out.print(nodes_table(body["nodes"]))


@nodes_app.command("reinstate")
def nodes_reinstate(ctx: typer.Context, node_id: str = typer.Argument(..., help="the node id")) -> None:
    """Clear a node's quarantine (publishes NodeReinstated with your token's name)."""
    from trainyard_cli.main import _api, out

    with _api(ctx) as client:
        body = client.post_json(f"/v1/admin/nodes/{node_id}/reinstate")
    out.print(f"node {body['nodeId']} reinstated by {body['by']} (the scheduler places on it again)")


@nodes_app.command("drain")
def nodes_drain(
    ctx: typer.Context,
    node_id: str = typer.Argument(..., help="the node id"),
    reason: str = typer.Option(None, "--reason", help="why (shown to the jobs that wait for it)"),
) -> None:
    """Take a node out of service on purpose: nothing new goes there, and the attempts running there
    checkpoint at an agreed step and stop, interrupted by maintenance (no failure, no blame); they resume
    elsewhere, or there after `undrain`."""
    from trainyard_cli.main import _api, out

    with _api(ctx) as client:
        body = client.post_json(f"/v1/admin/nodes/{node_id}/drain", {"reason": reason} if reason else None)
    out.print(f"node {body['nodeId']} drained by {body['by']}: its attempts checkpoint and stop; "
              f"`trainyard admin nodes undrain {body['nodeId']}` brings it back")


@nodes_app.command("undrain")
def nodes_undrain(ctx: typer.Context, node_id: str = typer.Argument(..., help="the node id")) -> None:
    """End a drain: the node takes new work again."""
    from trainyard_cli.main import _api, out

    with _api(ctx) as client:
        body = client.post_json(f"/v1/admin/nodes/{node_id}/undrain")
    out.print(f"node {body['nodeId']} undrained by {body['by']} (the scheduler places on it again)")
