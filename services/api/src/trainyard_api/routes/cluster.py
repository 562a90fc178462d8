"""The ``admin`` route over the cluster's topology: racks, NVLink domains, nodes and devices, with the job
holding each (platform-admin). The tenant's view of capacity and the queue is in :mod:`.dashboard`."""

from __future__ import annotations

from fastapi import APIRouter

from trainyard_api.cluster import AdminClusterView, ClusterService
from trainyard_api.deps import Admin, Ctx
from trainyard_api.http_errors import ADMIN_ERRORS

router = APIRouter()


@router.get("/v1/admin/cluster", response_model=AdminClusterView, tags=["admin"],
            summary="Racks, NVLink domains, nodes and devices, with the job holding each",
            responses=ADMIN_ERRORS)
async def admin_cluster(ctx: Ctx, _: Admin) -> AdminClusterView:
    """The topology (docs/design.md's terms), each node's state, quarantine and reputation score, and
    which job holds each device. Platform-admin."""
    return await ClusterService(ctx.store).admin_view()
