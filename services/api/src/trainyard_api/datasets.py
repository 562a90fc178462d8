"""Dataset versions as tenants see them: list and get what the caller may use, publish its own.

Visibility is :func:`trainyard_contract.records.dataset_visible` (the owner, the platform's, shared
with the caller's tenant or with "*"); a reference resolves as a submission resolves it
(:func:`trainyard_contract.records.resolve_dataset`). Another tenant's version that is not shared is
answered exactly like one that does not exist, so names do not leak. A rejected version is shown
to its owner only, with the registry's reason — and so is a refused re-publish of a verified one (another
sha256), beside the version that stands. A publish the API already knows to conflict with a verified version
is refused at once (409), never announced.
"""

from __future__ import annotations

from trainyard_contract.errors import ConflictError, NotFoundError
from trainyard_contract.events import DatasetVersionPublished, dataset_key
from trainyard_runtime.outbox import Outbox
from trainyard_contract.records import (
    DatasetRecord,
    DatasetRejection,
    TenantToken,
    dataset_candidates,
    dataset_conflict,
)
from trainyard_contract.storage import ArtifactLayout, location_uri
from trainyard_runtime.store import StateStore

from trainyard_api.bodies import DatasetPublishBody
from trainyard_api.schemas import DatasetPublished, DatasetRejectionView, DatasetView

NOT_FOUND = ("no dataset {ref!r} that your tenant may use: it is not published, not verified yet, or not "
             "shared with your tenant; GET /v1/datasets lists what you may use")
NOT_YET = ("no dataset {ref!r} with sha256 {sha256} that your tenant may use: the registry has not verified it "
           "yet (GET again), or it is not yours to see")


def owns(rejection: DatasetRejection, token: TenantToken) -> bool:
    """Only a version's owner reads why its publishes were refused (the platform's: platform-admins)."""
    return rejection.tenant == token.tenant if rejection.tenant else token.effective_role == "platform-admin"


def rejected_view(rejection: DatasetRejection, token: TenantToken) -> DatasetView | None:
    """The rejection as its owner sees it; None for anyone else."""
    if not owns(rejection, token):
        return None
    return DatasetView(name=rejection.name, version=rejection.version, tenant=rejection.tenant,
                       manifest_uri=rejection.manifest_uri, sha256=rejection.sha256,
                       published_at=rejection.rejected_at, state="rejected", reason=rejection.reason,
                       problems=rejection.problems)


def verified_view(record: DatasetRecord, rejection: DatasetRejection | None = None,
                  token: TenantToken | None = None) -> DatasetView:
    """A verified version; for its owner, with the refused publish of the same ref the registry keeps."""
    shown = [] if rejection is None or token is None or not owns(rejection, token) else [rejection]
    return DatasetView(**record.model_dump(), state="verified", rejections=[
        DatasetRejectionView(sha256=r.sha256, manifest_uri=r.manifest_uri, reason=r.reason, problems=r.problems,
                             rejected_at=r.rejected_at, published_event_id=r.published_event_id) for r in shown])


def publication_view(record: DatasetRecord | None, rejection: DatasetRejection | None, token: TenantToken,
                     sha256: str) -> DatasetView | None:
    """What became of the publish of ``sha256``: verified (the version is that content), rejected (the
    registry's latest refusal is of that content: its owner sees why), or None (not decided yet)."""
    if record is not None and record.sha256 == sha256:
        return verified_view(record, rejection, token)
    if rejection is not None and rejection.sha256 == sha256:
        return rejected_view(rejection, token)
    return None


class DatasetService:
    def __init__(self, store: StateStore, outbox: Outbox, layout: ArtifactLayout) -> None:
        self.store = store
        self.outbox = outbox
        self.layout = layout

    async def list(self, token: TenantToken) -> list[DatasetRecord]:
        records = await self.store.list_datasets(token.tenant)
        return sorted(records, key=lambda d: (d.tenant or "", d.name, d.version))

    async def get(self, token: TenantToken, ref: str, sha256: str | None = None) -> DatasetView:
        """The verified version ``ref`` names for the caller, else (for its owner) why it was rejected.
        With ``sha256``: what became of the publish of that content (verified, rejected, else a 404)."""
        record = await self.store.resolve_dataset(ref, token.tenant)
        if sha256 is not None:
            candidates = [record.ref] if record is not None else dataset_candidates(ref, token.tenant)
            for candidate in candidates:
                rejection = await self.store.get_dataset_rejection(candidate)
                if (view := publication_view(record, rejection, token, sha256)) is not None:
                    return view
            raise NotFoundError(NOT_YET.format(ref=ref, sha256=sha256))
        if record is not None:
            return verified_view(record, await self.store.get_dataset_rejection(record.ref), token)
        for candidate in dataset_candidates(ref, token.tenant):
            rejection = await self.store.get_dataset_rejection(candidate)
            if rejection is not None and (view := rejected_view(rejection, token)) is not None:
                return view
        raise NotFoundError(NOT_FOUND.format(ref=ref))

    async def publish(self, token: TenantToken, body: DatasetPublishBody) -> DatasetPublished:
        """Announce a version the caller's tenant owns; the registry verifies it before anyone sees it.
        Its manifest is where the tenant's prefix says (a ``file://`` URI, or the object's URL under an
        object-store root), never a path the client names. A version already verified with another
        sha256 is a :class:`ConflictError` (409), not an announcement the registry would only refuse."""
        ref = dataset_key(token.tenant, body.name, body.version)
        if (existing := await self.store.get_dataset(ref)) is not None:
            if conflict := dataset_conflict(existing, body.sha256):
                raise ConflictError(conflict)
        manifest = self.layout.dataset_dir(body.name, body.version, token.tenant) / "manifest.json"
        event = DatasetVersionPublished(
            name=body.name, version=body.version, tenant=token.tenant, manifest_uri=location_uri(manifest),
            sha256=body.sha256, shared_with=sorted(set(body.shared_with)), tokenizer=body.tokenizer,
            num_tokens=body.num_tokens,
        )
        await self.outbox.put(event)
        return DatasetPublished(dataset=dataset_key(token.tenant, body.name, body.version),
                                manifest_uri=event.manifest_uri)
