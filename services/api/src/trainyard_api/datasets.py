"""Dataset versions as tenants see them: list and get what the caller may use, publish its own.

Visibility is :func:`trainyard_common.records.dataset_visible` (the owner, the platform's, shared
with the caller's tenant or with "*"); a reference resolves as a submission resolves it
(:func:`trainyard_common.records.resolve_dataset`). Another tenant's version that is not shared is
answered exactly like one that does not exist, so names do not leak. A rejected version is shown
to its owner only, with the registry's reason.
"""

from __future__ import annotations

from trainyard_common.errors import NotFoundError
from trainyard_common.events import DatasetVersionPublished, dataset_key
from trainyard_common.outbox import Outbox
from trainyard_common.records import DatasetRecord, DatasetRejection, TenantToken, dataset_candidates
from trainyard_common.storage import ArtifactLayout, location_uri
from trainyard_common.store import StateStore

from trainyard_api.bodies import DatasetPublishBody
from trainyard_api.schemas import DatasetPublished, DatasetView

NOT_FOUND = ("no dataset {ref!r} that your tenant may use: it is not published, not verified yet, or not "
             "shared with your tenant; GET /v1/datasets lists what you may use")


def rejected_view(rejection: DatasetRejection, token: TenantToken) -> DatasetView | None:
    """The rejection as its owner sees it; None for anyone else (the platform's: platform-admins)."""
    owner = rejection.tenant == token.tenant if rejection.tenant else token.effective_role == "platform-admin"
    if not owner:
        return None
    return DatasetView(name=rejection.name, version=rejection.version, tenant=rejection.tenant,
                       manifest_uri=rejection.manifest_uri, sha256=rejection.sha256,
                       published_at=rejection.rejected_at, state="rejected", reason=rejection.reason,
                       problems=rejection.problems)


def verified_view(record: DatasetRecord) -> DatasetView:
    return DatasetView(**record.model_dump(), state="verified")


class DatasetService:
    def __init__(self, store: StateStore, outbox: Outbox, layout: ArtifactLayout) -> None:
        self.store = store
        self.outbox = outbox
        self.layout = layout

    async def list(self, token: TenantToken) -> list[DatasetRecord]:
        records = await self.store.list_datasets(token.tenant)
        return sorted(records, key=lambda d: (d.tenant or "", d.name, d.version))

    async def get(self, token: TenantToken, ref: str) -> DatasetView:
        """The verified version ``ref`` names for the caller, else (for its owner) why it was rejected."""
        if (record := await self.store.resolve_dataset(ref, token.tenant)) is not None:
            return verified_view(record)
        for candidate in dataset_candidates(ref, token.tenant):
            rejection = await self.store.get_dataset_rejection(candidate)
            if rejection is not None and (view := rejected_view(rejection, token)) is not None:
                return view
        raise NotFoundError(NOT_FOUND.format(ref=ref))

    async def publish(self, token: TenantToken, body: DatasetPublishBody) -> DatasetPublished:
        """Announce a version the caller's tenant owns; the registry verifies it before anyone sees it.
        Its manifest is where the tenant's prefix says (a ``file://`` URI, or the object's URL under an
        object-store root), never a path the client names."""
        manifest = self.layout.dataset_dir(body.name, body.version, token.tenant) / "manifest.json"
        event = DatasetVersionPublished(
            name=body.name, version=body.version, tenant=token.tenant, manifest_uri=location_uri(manifest),
            sha256=body.sha256, shared_with=sorted(set(body.shared_with)), tokenizer=body.tokenizer,
            num_tokens=body.num_tokens,
        )
        await self.outbox.put(event)
        return DatasetPublished(dataset=dataset_key(token.tenant, body.name, body.version),
                                manifest_uri=event.manifest_uri)
