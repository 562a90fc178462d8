"""A tenant's tracking targets, administered through the API (``/v1/admin/tenants/{tenant}/tracking``): the
MLflow server the telemetry service sends the tenant's jobs' curves to, and whether TensorBoard event files are
written (docs/tracking.md). A platform-admin sets them (the URI is egress from the control plane); the tenant's
admin reads them. Stored as ``TenantTracking`` in ``Keys.tracking_tenants``; the exporter re-reads it every pass.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from trainyard_contract.events import utcnow
from trainyard_contract.records import TenantToken
from trainyard_contract.tracking import MAX_URI_LENGTH, MlflowUri, TenantTracking
from trainyard_runtime.replication import write_confirmed
from trainyard_runtime.store import Keys, StateStore

__all__ = ["TenantTrackingBody", "TenantTrackingService"]


class TenantTrackingBody(BaseModel):
    """A tenant's tracking targets, replaced whole: `mlflowUri` null (or absent) turns MLflow export off."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    mlflow_uri: MlflowUri | None = Field(
        default=None, max_length=MAX_URI_LENGTH, examples=["http://mlflow.research.internal:5000"],
        description="the MLflow tracking server, http(s)://host[:port][/path]: no credentials, not a link-local "
                    "or cloud-metadata address")
    tensorboard: bool = Field(default=False, description="write TensorBoard event files into each job's directory "
                                                         "(tensorboard/ under the job's prefix)")


class TenantTrackingService:
    def __init__(self, store: StateStore) -> None:
        self.redis = store.redis

    async def get(self, tenant: str) -> TenantTracking:
        """The tenant's targets (none set: no MLflow, no TensorBoard)."""
        raw = await self.redis.hget(Keys.tracking_tenants, tenant)
        return TenantTracking.model_validate_json(raw) if raw else TenantTracking()

    async def put(self, actor: TenantToken, tenant: str, body: TenantTrackingBody) -> TenantTracking:
        record = TenantTracking(mlflow_uri=body.mlflow_uri, tensorboard=body.tensorboard, updated_at=utcnow(),
                                updated_by=actor.token_id)
        await write_confirmed(self.redis, lambda p: p.hset(Keys.tracking_tenants, tenant, record.dumps()))
        return record
