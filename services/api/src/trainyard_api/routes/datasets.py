"""The ``datasets`` routes: list the dataset versions a tenant may train on, publish one, read one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from trainyard_contract.records import TenantToken
from trainyard_contract.spec import DATASET_REF_PATTERN

from trainyard_api.bodies import DatasetPublishBody
from trainyard_api.deps import Ctx, Tenant, may, strict_body
from trainyard_api.http_errors import AUTH_ERRORS, NOT_JSON, error, invalid
from trainyard_api.roles import Right
from trainyard_api.schemas import DatasetList, DatasetPublished, DatasetView

_PUBLISH = may(Right.SUBMIT, "dataset.publish")
SHA256_PATTERN = r"^[0-9a-f]{64}$"
Publisher = Annotated[TenantToken, _PUBLISH]

router = APIRouter()


@router.get("/v1/datasets", response_model=DatasetList, tags=["datasets"], summary="List datasets",
            responses=AUTH_ERRORS)
async def list_datasets(ctx: Ctx, tenant: Tenant) -> DatasetList:
    """The verified versions the caller may train on: its tenant's, the platform's, and those shared
    with its tenant (`tenant` is the owner, null for the platform's; `sharedWith` whom it is shared with)."""
    return DatasetList(tenant=tenant.tenant, datasets=await ctx.datasets.list(tenant))


@router.post("/v1/datasets", status_code=202, response_model=DatasetPublished, tags=["datasets"],
             summary="Publish a dataset version", dependencies=[strict_body(DatasetPublishBody, _PUBLISH)],
             responses={
                 202: {"headers": {"Location": {"description": "where to poll the version's state",
                                                "required": True, "schema": {"type": "string"}}}},
                 **AUTH_ERRORS, **NOT_JSON,
                 **error(409, "the version is verified already with another sha256 (versions are immutable: "
                              "publish new content under a new name@version)"),
                 **invalid("a body field out of bounds, named by field")})
async def publish_dataset(ctx: Ctx, tenant: Publisher, request: Request, response: Response,
                          body: DatasetPublishBody) -> DatasetPublished:
    """Announce a version of the caller's tenant whose files are in place under its prefix
    (`tenants/<tenant>/datasets/<name>/<version>/`, see `trainyard datasets import`). The registry
    verifies the manifest's sha256 and every shard before the version is visible; `GET` the
    `Location` (the version's URL with `?sha256=` of this publish) to see this publish `verified`, or
    `rejected` with the reason (404 until the registry has decided). A version already verified with another
    sha256 is a 409 with the reason; the same sha256 again is accepted and changes nothing. Submitter or
    above."""
    published = await ctx.datasets.publish(tenant, body)
    request.state.audit_target = f"dataset/{published.dataset}"
    response.headers["Location"] = (f"{ctx.settings.public_url}/v1/datasets/{published.dataset}"
                                    f"?sha256={body.sha256}")
    return published


@router.get("/v1/datasets/{ref:path}", response_model=DatasetView, tags=["datasets"], summary="Get a dataset",
            responses={**AUTH_ERRORS, **error(404, "not published, not verified (with sha256: that content not "
                                                   "decided yet), or not visible to the caller's tenant"),
                       **invalid()})
async def get_dataset(
    ctx: Ctx, tenant: Tenant,
    ref: Annotated[str, Path(pattern=DATASET_REF_PATTERN, max_length=256,
                             description="name@version (the caller's own, else the platform's) or "
                                         "tenant/name@version",
                             examples=["tinycorpus@v1"])],
    sha256: Annotated[str | None, Query(pattern=SHA256_PATTERN, description=(
        "what became of the publish of this manifest sha256 (the POST's Location names it): the version if it "
        "is this content, its owner's rejection if the registry refused this content, else 404"))] = None,
) -> DatasetView:
    """A verified version the caller may use — for its owner with `rejections`: a publish of the same
    ref the registry refused (a re-publish with another sha256), the version itself unchanged; for the
    version's owner, also one the registry rejected (`state` rejected, with `reason` and `problems`).
    Anything else is a 404."""
    return await ctx.datasets.get(tenant, ref, sha256)
