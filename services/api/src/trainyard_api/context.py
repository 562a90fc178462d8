"""What the routes need from the process: the settings, the state store, the outbox, the bus, and the
services over them, each built once on first use."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from fastapi import Request

from trainyard_contract.storage import ArtifactLayout
from trainyard_runtime.bus import Bus
from trainyard_runtime.outbox import Outbox
from trainyard_runtime.store import StateStore
from trainyard_telemetry.accounting import GoodputAccountant
from trainyard_telemetry.calibrator import CalibrationStore
from trainyard_telemetry.steptiming import StepTimingStore

from trainyard_api.admin import AdminService
from trainyard_api.audit import AuditLog
from trainyard_api.code import CodeService, CodeStore, GitSource
from trainyard_api.datasets import DatasetService
from trainyard_api.experiments import ExperimentService, ExperimentStore
from trainyard_api.exports import ExportService
from trainyard_api.jobs import JobService
from trainyard_api.settings import ApiSettings
from trainyard_api.tenants import TenantService
from trainyard_api.triggers import TriggerService, TriggerStore


@dataclass
class ApiContext:
    """What the routes need from the process: state, the outbox, the bus (for health), and the services
    over them — each built once, on first use (none keeps per-request state)."""

    settings: ApiSettings
    store: StateStore
    outbox: Outbox
    bus: Bus | None = None

    @cached_property
    def jobs(self) -> JobService:
        return JobService(self.store, self.outbox, max_attempts=self.settings.api_max_attempts, code=self.code,
                          layout=ArtifactLayout(self.settings.artifact_root_abs))

    @cached_property
    def triggers(self) -> TriggerService:
        return TriggerService(TriggerStore(self.store.redis), self.jobs)

    @cached_property
    def experiments(self) -> ExperimentService:
        return ExperimentService(ExperimentStore(self.store.redis), self.jobs)

    @cached_property
    def code(self) -> CodeService:
        """Code archives under the artifact root, and git for ``code.repo``."""
        s = self.settings
        return CodeService(CodeStore(ArtifactLayout(s.artifact_root_abs), max_bytes=s.api_max_code_bytes),
                           GitSource(timeout_s=s.api_git_timeout_s, max_bytes=s.api_max_code_bytes,
                                     local_repos=s.api_git_local_repos))

    @cached_property
    def datasets(self) -> DatasetService:
        return DatasetService(self.store, self.outbox, ArtifactLayout(self.settings.artifact_root_abs))

    @cached_property
    def exports(self) -> ExportService:
        return ExportService(self.store, self.outbox, ArtifactLayout(self.settings.artifact_root_abs))

    @cached_property
    def admin(self) -> AdminService:
        return AdminService(self.store, self.outbox)

    @cached_property
    def tenants(self) -> TenantService:
        return TenantService(self.store)

    @cached_property
    def audit(self) -> AuditLog:
        return AuditLog(self.store.redis, max_entries=self.settings.api_audit_max_entries)

    @cached_property
    def accounting(self) -> GoodputAccountant:
        s = self.settings
        return GoodputAccountant(self.store, StepTimingStore(self.store.redis),
                                 history_bucket_s=s.goodput_history_bucket_s,
                                 history_retention_s=s.goodput_history_retention_s)

    @cached_property
    def calibrations(self) -> CalibrationStore:
        """The planner's calibration samples and fit (written by the telemetry service's Calibrator)."""
        return CalibrationStore(self.store.redis, max_samples=self.settings.calibration_max_samples)


def context_of(request: Request) -> ApiContext:
    """The app's context (``create_app`` puts it on ``app.state``); a dependency of every route."""
    return request.app.state.context
