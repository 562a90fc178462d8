"""The API's settings: the shared ``ServiceSettings`` plus where to listen, how to page, and what
the planner's calibration assumes and keeps."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr

from trainyard_contract import codetree
from trainyard_planner.platform import Assumptions
from trainyard_telemetry.settings import ReadModelSettings



def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


class ApiSettings(ReadModelSettings):
    """``TRAINYARD_*`` variables of the API process (parsed once in ``main()``)."""

    api_host: str = Field(default="127.0.0.1", description="interface the HTTP server binds")
    api_port: int = Field(
        default=8080, ge=0, lt=65536, description="HTTP port, 0 picks a free one (TRAINYARD_PORT is read too)",
        validation_alias=AliasChoices("api_port", "TRAINYARD_API_PORT", "TRAINYARD_PORT"),
    )
    api_public_url: str | None = Field(
        default=None, description="base URL clients use, for Location headers; defaults to http://host:port"
    )
    api_page_limit: int = Field(default=50, gt=0, description="list page size when the client gives none")
    api_max_page_limit: int = Field(default=500, gt=0, description="largest page a client may ask for")
    api_max_attempts: int = Field(default=3, gt=0, le=100, description="attempt budget of a new job")
    api_access_log: bool = Field(default=False, description="log every HTTP request (uvicorn access log)")
    api_workers: int = Field(
        default=1, ge=1, le=64,
        description="HTTP worker processes on the one port (SO_REUSEPORT): this process plus api_workers - 1 it "
                    "starts and keeps running; every one runs the same (its own outbox, the triggers' shared "
                    "consumer group, its live-updates feed)")
    api_worker_index: int = Field(default=0, ge=0, description="set by the API for its HTTP workers (1, 2, …)")
    api_max_code_bytes: int = Field(
        default=codetree.MAX_ARCHIVE_BYTES, gt=0,
        description="largest code archive PUT /v1/code/{archive} takes, and code.repo may archive to (bytes)")
    api_git_timeout_s: float = Field(default=60.0, gt=0,
                                     description="how long one git command may take resolving code.repo")
    api_git_local_repos: bool = Field(
        default=False, description="whether code.repo may name a repository on the API's machine (a path or a "
                                   "file:// URL): any tenant could then archive any checkout the API can read, so "
                                   "it is off unless an operator turns it on (the local stack, `make up`, does: "
                                   "one user's own machine)")

    api_metrics_token: SecretStr | None = Field(
        default=None,
        description="a bearer token that may read GET /metrics on the API's port (for a scraper), besides any "
                    "platform-admin token; the metrics name tenants and jobs")
    api_public_metrics: bool = Field(
        default=False, description="serve GET /metrics on the API's port without a token (where only operators "
                                   "reach that port); the metrics port (TRAINYARD_METRICS_PORT) is unaffected")

    api_bootstrap_admin_token_file: Path | None = Field(
        default=None,
        description="at start-up, when no active platform-admin token exists, create one and write it to this file "
                    "(mode 0600); the local stack sets .trainyard/admin-token")
    api_bootstrap_admin_tenant: str = Field(
        default="platform", pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$",
        description="the tenant the bootstrap platform-admin token belongs to (created if missing)")
    api_audit_max_entries: int = Field(
        default=100_000, gt=0, description="entries the audit log keeps (all tenants, and per tenant), newest kept")

    cpu_memory_bytes: float = Field(default_factory=_host_memory_bytes, gt=0,
                                    description="memory of a cpu device for planning (default: this host's)")
    # cpu_peak_flops, calibration_write_bandwidth, calibration_max/min_samples and goodput_history_* are
    # ReadModelSettings' (shared with the telemetry service that writes what these queries read); the ingest's
    # own settings (calibration_refresh_s, goodput_refresh_s, …) are TelemetrySettings'

    @property
    def assumptions(self) -> Assumptions:
        """What the planner assumes for this platform where a request or a spec says nothing."""
        return Assumptions(cpu_peak_flops=self.cpu_peak_flops, cpu_memory_bytes=self.cpu_memory_bytes,
                           write_bandwidth=self.calibration_write_bandwidth)

    @property
    def public_url(self) -> str:
        if self.api_public_url:
            return self.api_public_url.rstrip("/")
        return f"http://{self.api_host}:{self.api_port}"
