"""The ``admin`` routes over nodes: the inventory, reinstating a quarantined node, draining and undraining
one for maintenance (platform-admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from trainyard_contract.records import TenantToken

from trainyard_api.deps import Admin, Ctx, may
from trainyard_api.http_errors import ADMIN_ERRORS, error, invalid
from trainyard_api.roles import Right
from trainyard_api.schemas import DrainResponse, NodeList, ReinstateResponse

NodeReinstater = Annotated[TenantToken, may(Right.NODES, "node.reinstate", platform=True)]
NodeDrainer = Annotated[TenantToken, may(Right.NODES, "node.drain", platform=True)]
NodeUndrainer = Annotated[TenantToken, may(Right.NODES, "node.undrain", platform=True)]
NodeId = Annotated[str, Path(max_length=128, description="the node id", examples=["node-a"])]
DrainReason = Annotated[str | None, Query(max_length=500, description="why (shown to the jobs that wait)")]

router = APIRouter()


@router.get("/v1/admin/nodes", response_model=NodeList, tags=["admin"], summary="List nodes",
            responses=ADMIN_ERRORS)
async def list_nodes(ctx: Ctx, _: Admin) -> NodeList:
    """Every node the scheduler knows: devices, rack, NVLink domain, network tier, health, last
    heartbeat, quarantine (reason, by, score, until) and the decaying reputation score (null
    when none is recorded)."""
    return NodeList(nodes=await ctx.admin.nodes())


@router.post("/v1/admin/nodes/{node_id}/reinstate", status_code=202, response_model=ReinstateResponse,
             tags=["admin"], summary="Reinstate a quarantined node",
             responses={**ADMIN_ERRORS, **error(404, "no such node"), **invalid()})
async def reinstate_node(ctx: Ctx, admin: NodeReinstater, node_id: NodeId) -> ReinstateResponse:
    """Publish NodeReinstated (`by` = the admin token's name); the scheduler clears the
    quarantine and places on the node again."""
    return await ctx.admin.reinstate(admin, node_id)


@router.post("/v1/admin/nodes/{node_id}/drain", status_code=202, response_model=DrainResponse,
             tags=["admin"], summary="Drain a node (maintenance)",
             responses={**ADMIN_ERRORS, **error(404, "no such node"), **invalid()})
async def drain_node(ctx: Ctx, admin: NodeDrainer,
                     node_id: NodeId, reason: DrainReason = None) -> DrainResponse:
    """Publish NodeDrained (`by` = the admin token's name): nothing new is placed on the node, and
    the attempts running there checkpoint at an agreed step and stop, interrupted by maintenance
    (no failure budget spent, nobody blamed); they resume from that checkpoint elsewhere, or there
    after an undrain or a restart of its node agent."""
    return await ctx.admin.drain(admin, node_id, reason)


@router.post("/v1/admin/nodes/{node_id}/undrain", status_code=202, response_model=DrainResponse,
             tags=["admin"], summary="Undrain a node",
             responses={**ADMIN_ERRORS, **error(404, "no such node"), **invalid()})
async def undrain_node(ctx: Ctx, admin: NodeUndrainer,
                       node_id: NodeId, reason: DrainReason = None) -> DrainResponse:
    """Publish NodeUndrained: the node takes new work again."""
    return await ctx.admin.undrain(admin, node_id, reason)
