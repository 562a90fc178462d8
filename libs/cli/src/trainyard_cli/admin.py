"""`trainyard admin …`: tenants, tokens, the audit log and nodes — all through the API (/v1/admin/…).

The token is the admin token (see config.py: --token / TRAINYARD_TOKEN, else the local stack's
.trainyard/admin-token, else its dev token). A connection problem or a refusal is one line saying what
to do, never a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.text import Text

from trainyard_contract.errors import ConfigError

from trainyard_cli.client import ApiClient
from trainyard_cli.console import stderr, stdout
from trainyard_cli.credentials import credentials_app
from trainyard_cli.tables import Col, Fitted

admin_app = typer.Typer(help="Administration through the API: tenants (quotas, priority), tokens (roles, expiry, "
                             "revocation), the audit log, nodes. Uses .trainyard/admin-token when present.",
                        no_args_is_help=True)
nodes_app = typer.Typer(help="Nodes: inventory, quarantine, reputation; reinstate, drain, undrain (platform-admin).",
                        no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants and their queue settings (platform-admin; a tenant-admin may `get` its own).",
                          no_args_is_help=True)
tokens_app = typer.Typer(help="A tenant's API tokens (tenant-admin of it, or platform-admin).", no_args_is_help=True)
admin_app.add_typer(tenants_app, name="tenants")
admin_app.add_typer(tokens_app, name="tokens")
admin_app.add_typer(nodes_app, name="nodes")
admin_app.add_typer(credentials_app, name="credentials")

ROLES = ("viewer", "submitter", "tenant-admin", "platform-admin")
TenantArg = Annotated[str, typer.Argument(help="the tenant")]
TenantOpt = Annotated[str, typer.Option("--tenant", help="the tenant")]
JsonFlag = Annotated[bool, typer.Option("--json", help="print the API's JSON")]
_DURATION = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


# ----------------------------------------------------------------------------- pure helpers


def parse_duration(text: str) -> int:
    """``90``, ``90s``, ``15m``, ``12h``, ``30d``, ``2w`` → seconds; ConfigError otherwise."""
    match = _DURATION.match(text)
    if not match or int(match.group(1)) <= 0:
        raise ConfigError(f"--ttl {text!r}: give a positive duration such as 3600, 15m, 12h, 30d or 2w")
    return int(match.group(1)) * _UNITS[match.group(2)]


def quota_limit(text: str | None, option: str) -> int | None:
    """A quota bound: a number of devices, or ``unlimited`` / ``none`` (null)."""
    if text is None or text.strip().lower() in ("unlimited", "none", "null"):
        return None
    if not text.strip().isdigit():
        raise ConfigError(f"{option} {text!r}: give a number of devices or 'unlimited'")
    return int(text)


def parse_quota(text: str) -> tuple[str, dict[str, int | None]]:
    """``KIND=GUARANTEED[:BORROW]`` (``cpu=8:4``, ``*=0``, ``h100-80gb=unlimited``) → (kind, quota)."""
    kind, sep, value = text.partition("=")
    if not sep or not kind.strip():
        raise ConfigError(f"--quota {text!r}: write DEVICE=GUARANTEED[:BORROW], e.g. cpu=8:4")
    guaranteed, _, borrow = value.partition(":")
    return kind.strip(), {"guaranteed": quota_limit(guaranteed, "--quota"),
                          "borrowLimit": quota_limit(borrow or None, "--quota")}


def _limit(value: Any) -> str:
    return "unlimited" if value is None else str(value)


TENANT_COLUMNS = (
    Col("TENANT", keep=100), Col("QUOTAS (guaranteed+borrow)", "wrap", keep=90, min_width=26),
    Col("WEIGHT", keep=60, justify="right"), Col("MAX PRIORITY", keep=40, justify="right"),
    Col("COHORT", "middle", keep=50, min_width=8), Col("TOKENS", keep=30, justify="right"),
    Col("CREATED", "middle", keep=20, min_width=12),
)
TOKEN_COLUMNS = (
    Col("ID", keep=100), Col("NAME", "middle", keep=80, min_width=10), Col("ROLE", keep=90), Col("STATE", keep=95),
    Col("CREATED", keep=40), Col("EXPIRES", keep=60), Col("REVOKED", keep=50),
)
AUDIT_COLUMNS = (
    Col("AT", keep=100), Col("ACTOR (tenant, role)", "wrap", keep=70, min_width=20),
    Col("ACTION", keep=95), Col("TARGET", "middle", keep=80, min_width=16), Col("OUTCOME", keep=90),
    Col("DETAIL", "wrap", keep=60, min_width=20),
)


def tenants_table(tenants: Sequence[Mapping[str, Any]]) -> Fitted:
    table = Fitted(None, TENANT_COLUMNS)
    for t in tenants:
        s = t.get("settings") or {}
        quotas = ", ".join(f"{k}: {_limit(q.get('guaranteed'))}+{_limit(q.get('borrowLimit'))}"
                           for k, q in sorted((s.get("quotas") or {}).items())) or "unlimited"
        table.add_row(t["tenant"], quotas if t.get("settingsStored") else f"{quotas} (defaults)",
                      str(s.get("weight", 1)), _limit(s.get("maxPriority")).replace("unlimited", "-"),
                      s.get("cohort") or "default", str(t.get("activeTokens", 0)), str(t.get("createdAt") or "-"))
    return table


def tokens_table(tokens: Sequence[Mapping[str, Any]]) -> Fitted:
    table = Fitted(None, TOKEN_COLUMNS)
    for t in tokens:
        table.add_row(t["tokenId"], t["name"], t["role"], t["state"], str(t.get("createdAt") or "-"),
                      str(t.get("expiresAt") or "never"), str(t.get("revokedAt") or "-"))
    return table


def audit_table(entries: Sequence[Mapping[str, Any]]) -> Fitted:
    table = Fitted(None, AUDIT_COLUMNS)
    for e in entries:
        table.add_row(e["at"], f"{e['actorName']} ({e['actorTenant']}, {e['actorRole']})", e["action"], e["target"],
                      e["outcome"], e.get("detail") or "")
    return table


# ----------------------------------------------------------------------------- the API


@contextmanager
def _admin(ctx: typer.Context) -> Iterator[ApiClient]:
    """An API client with the admin token; every trainyard error becomes one line (exit 1; 2: configuration)."""
    from trainyard_cli.main import _api

    with _api(ctx, admin=True, what="request") as client:
        yield client


def _emit(body: Any, as_json: bool, table: Any) -> None:
    if as_json:
        from trainyard_cli.main import _print_json

        _print_json(body)
    else:
        stdout().print(table)


# ----------------------------------------------------------------------------- tenants


def _settings(weight: float | None, cohort: str | None, max_priority: str | None,
              quotas: Sequence[str]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if weight is not None:
        body["weight"] = weight
    if cohort is not None:
        body["cohort"] = cohort
    if max_priority is not None:
        text = max_priority.strip().lower()
        if text not in ("none", "null") and not re.fullmatch(r"-?\d+", text):
            raise ConfigError(f"--max-priority {max_priority!r}: give an integer (-1000..1000) or 'none'")
        body["maxPriority"] = None if text in ("none", "null") else int(text)
    if quotas:
        body["quotas"] = dict(parse_quota(q) for q in quotas)
    return body


Weight = Annotated[float | None, typer.Option("--weight", help="fair-share weight (default 1)")]
Cohort = Annotated[str | None, typer.Option("--cohort", help="tenants of one cohort share its limits")]
MaxPriority = Annotated[str | None, typer.Option(
    "--max-priority", help="cap on its jobs' spec.priority, so on the priority class they reach ('none': no cap)")]
Quotas = Annotated[list[str] | None, typer.Option(
    "--quota", help="DEVICE=GUARANTEED[:BORROW], repeatable: cpu=8:4, '*=0', h100-80gb=unlimited")]


@tenants_app.command("create")
def tenants_create(ctx: typer.Context, tenant: TenantArg, weight: Weight = None, cohort: Cohort = None,
                   max_priority: MaxPriority = None, quota: Quotas = None, as_json: JsonFlag = False) -> None:
    """Create a tenant (then issue its tokens with `trainyard admin tokens create --tenant NAME`)."""
    with _admin(ctx) as client:  # bad options are ConfigErrors: one line, exit 2
        body = client.call_json("POST", "/v1/admin/tenants",
                                body={"tenant": tenant, **_settings(weight, cohort, max_priority, quota or [])})
    _emit(body, as_json, tenants_table([body]))


@tenants_app.command("list")
def tenants_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every tenant with its quotas, weight, priority cap and number of active tokens."""
    with _admin(ctx) as client:
        body = client.call_json("GET", "/v1/admin/tenants")
    _emit(body, as_json, tenants_table(body["tenants"]))


@tenants_app.command("get")
def tenants_get(ctx: typer.Context, tenant: TenantArg, as_json: JsonFlag = False) -> None:
    """One tenant's queue settings as the scheduler applies them."""
    with _admin(ctx) as client:
        body = client.call_json("GET", f"/v1/admin/tenants/{tenant}")
    _emit(body, as_json, tenants_table([body]))


@tenants_app.command("set-quota")
def tenants_set_quota(
    ctx: typer.Context, tenant: TenantArg,
    device: Annotated[str | None, typer.Option("--device", help="device type ('*': every other type)")] = None,
    guaranteed: Annotated[str | None, typer.Option("--guaranteed", help="devices reserved ('unlimited')")] = None,
    borrow_limit: Annotated[str | None, typer.Option("--borrow-limit", help="devices above it it may borrow "
                                                                            "('unlimited')")] = None,
    remove: Annotated[bool, typer.Option("--remove", help="remove the device type's quota")] = False,
    weight: Weight = None, cohort: Cohort = None, max_priority: MaxPriority = None, as_json: JsonFlag = False,
) -> None:
    """Change a tenant's quota of one device type (and/or its weight, cohort, priority cap); the scheduler
    applies it at its next reconcile, without a restart."""
    with _admin(ctx) as client:  # bad options are ConfigErrors: one line, exit 2
        body = _settings(weight, cohort, max_priority, [])
        if device is not None:
            body["quotas"] = {device: None if remove else {
                "guaranteed": quota_limit(guaranteed, "--guaranteed"),
                "borrowLimit": quota_limit(borrow_limit, "--borrow-limit")}}
        elif guaranteed is not None or borrow_limit is not None or remove:
            raise ConfigError("--guaranteed, --borrow-limit and --remove need --device")
        if not body:
            raise ConfigError("nothing to change: give --device with --guaranteed/--borrow-limit/--remove, "
                              "--weight, --cohort or --max-priority")
        result = client.call_json("PATCH", f"/v1/admin/tenants/{tenant}", body=body)
    _emit(result, as_json, tenants_table([result]))


def _tracking_line(tenant: str, body: Mapping[str, Any]) -> str:
    uri = body.get("mlflowUri") or "off"
    return f"{tenant}: MLflow {uri}, TensorBoard {'on' if body.get('tensorboard') else 'off'}"


@tenants_app.command("tracking")
def tenants_tracking(ctx: typer.Context, tenant: TenantArg, as_json: JsonFlag = False) -> None:
    """A tenant's tracking targets: the MLflow server its jobs' curves go to, TensorBoard files (docs/tracking.md)."""
    with _admin(ctx) as client:
        body = client.call_json("GET", f"/v1/admin/tenants/{tenant}/tracking")
    _emit(body, as_json, _tracking_line(tenant, body))


@tenants_app.command("set-tracking")
def tenants_set_tracking(
    ctx: typer.Context, tenant: TenantArg,
    mlflow_uri: Annotated[str, typer.Option("--mlflow-uri", help="the MLflow tracking server, http(s)://host[:port] "
                                                                 "('none': no MLflow export)")] = "none",
    tensorboard: Annotated[bool, typer.Option("--tensorboard/--no-tensorboard",
                                              help="write TensorBoard event files into each job's directory")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Set a tenant's tracking targets (platform-admin: the URI is egress from the control plane)."""
    uri = None if mlflow_uri.strip().lower() in ("", "none", "null") else mlflow_uri
    with _admin(ctx) as client:
        body = client.call_json("PUT", f"/v1/admin/tenants/{tenant}/tracking",
                                body={"mlflowUri": uri, "tensorboard": tensorboard})
    _emit(body, as_json, _tracking_line(tenant, body))


@tenants_app.command("delete")
def tenants_delete(ctx: typer.Context, tenant: TenantArg,
                   yes: Annotated[bool, typer.Option("--yes", help="do not ask")] = False) -> None:
    """Delete a tenant: every token of it is revoked (refused while it has unfinished jobs)."""
    if not yes:
        typer.confirm(f"delete tenant {tenant!r} and revoke all its tokens?", abort=True, err=True)
    with _admin(ctx) as client:
        client.call_json("DELETE", f"/v1/admin/tenants/{tenant}")
    stdout().print(f"tenant {tenant} deleted; its tokens are revoked")


# ----------------------------------------------------------------------------- tokens


Role = Annotated[str, typer.Option("--role", help=f"one of {', '.join(ROLES)}")]


def _issue(ctx: typer.Context, tenant: str, name: str, role: str, ttl: str | None, expires_at: str | None) -> None:
    body: dict[str, Any] = {"name": name, "role": role}
    if expires_at is not None:
        body["expiresAt"] = expires_at
    with _admin(ctx) as client:  # a bad --ttl is a ConfigError: one line, exit 2
        if ttl is not None:
            body["ttlSeconds"] = parse_duration(ttl)
        issued = client.call_json("POST", f"/v1/admin/tenants/{tenant}/tokens", body=body)
    expiry = f", expires {issued['expiresAt']}" if issued.get("expiresAt") else ""
    stderr().print(Text.assemble(f"token {issued['tokenId']} for tenant ", (tenant, "bold"),
                                 f" ({name}, {issued['role']}{expiry}); it is not shown again:"))
    print(issued["token"])


Ttl = Annotated[str | None, typer.Option("--ttl", help="expires after this long: 3600, 15m, 12h, 30d, 2w")]
ExpiresAt = Annotated[str | None, typer.Option("--expires-at", help="expires at this instant (RFC 3339)")]


@tokens_app.command("create")
def tokens_create(ctx: typer.Context, tenant: TenantOpt,
                  name: Annotated[str, typer.Option("--name", help="a label (shown as submittedBy)")] = "default",
                  role: Role = "submitter", ttl: Ttl = None, expires_at: ExpiresAt = None) -> None:
    """Issue a token for TENANT and print it once (only its sha256 is stored)."""
    _issue(ctx, tenant, name, role, ttl, expires_at)


@tokens_app.command("list")
def tokens_list(ctx: typer.Context, tenant: TenantOpt, as_json: JsonFlag = False) -> None:
    """The tenant's tokens, without their secrets: id, name, role, state, expiry."""
    with _admin(ctx) as client:
        body = client.call_json("GET", f"/v1/admin/tenants/{tenant}/tokens")
    _emit(body, as_json, tokens_table(body["tokens"]))


@tokens_app.command("revoke")
def tokens_revoke(ctx: typer.Context, token_id: Annotated[str, typer.Argument(help="the token's id (tok_…)")],
                  tenant: TenantOpt) -> None:
    """Revoke a token: every API process refuses it from the next request on."""
    with _admin(ctx) as client:
        body = client.call_json("DELETE", f"/v1/admin/tenants/{tenant}/tokens/{token_id}")
    stdout().print(f"token {body['tokenId']} ({body['name']}) of tenant {tenant} revoked at {body['revokedAt']}")


@admin_app.command("create-token")
def create_token(
    ctx: typer.Context, tenant: TenantOpt,
    name: Annotated[str, typer.Option("--name", help="a label for the token (shown as submittedBy)")] = "default",
    admin: Annotated[bool, typer.Option("--admin", help="a platform-admin token (same as --role platform-admin)")
                     ] = False,
    role: Annotated[str | None, typer.Option("--role", help=f"one of {', '.join(ROLES)} (default submitter)")] = None,
    ttl: Ttl = None,
) -> None:
    """Issue a token for TENANT and print it once: `trainyard admin tokens create` by its old name."""
    _issue(ctx, tenant, name, role or ("platform-admin" if admin else "submitter"), ttl, None)


# ----------------------------------------------------------------------------- audit


@admin_app.command("audit")
def audit(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option("--tenant", help="only this tenant's entries")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="how many, newest first")] = 50,
    as_json: JsonFlag = False,
) -> None:
    """The audit log: administrative actions and job control, who did what, when, and how it ended."""
    with _admin(ctx) as client:
        body = client.call_json("GET", "/v1/admin/audit", params={"tenant": tenant, "limit": limit})
    _emit(body, as_json, audit_table(body["entries"]))


# ----------------------------------------------------------------------------- nodes


@nodes_app.command("list")
def nodes_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every node: devices, health, quarantine (reason, by) and reputation score."""
    from trainyard_cli.render import nodes_table

    with _admin(ctx) as client:
        body = client.get_json("/v1/admin/nodes")
    _emit(body, as_json, nodes_table(body["nodes"]) if not as_json else None)


@nodes_app.command("reinstate")
def nodes_reinstate(ctx: typer.Context, node_id: str = typer.Argument(..., help="the node id")) -> None:
    """Clear a node's quarantine (publishes NodeReinstated with your token's name)."""
    with _admin(ctx) as client:
        body = client.post_json(f"/v1/admin/nodes/{node_id}/reinstate")
    stdout().print(f"node {body['nodeId']} reinstated by {body['by']} (the scheduler places on it again)")


@nodes_app.command("drain")
def nodes_drain(
    ctx: typer.Context,
    node_id: str = typer.Argument(..., help="the node id"),
    reason: str = typer.Option(None, "--reason", help="why (shown to the jobs that wait for it)"),
) -> None:
    """Take a node out of service on purpose: nothing new goes there, and the attempts running there
    checkpoint at an agreed step and stop, interrupted by maintenance (no failure, no blame); they resume
    elsewhere, or there after `undrain`."""
    with _admin(ctx) as client:
        body = client.post_json(f"/v1/admin/nodes/{node_id}/drain", {"reason": reason} if reason else None)
    stdout().print(f"node {body['nodeId']} drained by {body['by']}: its attempts checkpoint and stop; "
                   f"`trainyard admin nodes undrain {body['nodeId']}` brings it back")


@nodes_app.command("undrain")
def nodes_undrain(ctx: typer.Context, node_id: str = typer.Argument(..., help="the node id")) -> None:
    """End a drain: the node takes new work again."""
    with _admin(ctx) as client:
        body = client.post_json(f"/v1/admin/nodes/{node_id}/undrain")
    stdout().print(f"node {body['nodeId']} undrained by {body['by']} (the scheduler places on it again)")
