"""The FastAPI application: the OpenAPI document's front matter, and ``create_app``, which assembles the
routers of :mod:`trainyard_api.routes`, the error handlers and the dashboard over an :class:`ApiContext`.

``create_app(context)`` builds the app over an :class:`ApiContext` (Redis-backed store,
outbox, bus); the process wiring (uvicorn next to a ServiceRuntime) lives in ``server.py``.
Errors from ``trainyard_contract.errors`` map to HTTP as :mod:`trainyard_api.http_errors` says; every route
documents each status it can answer, with its body.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline

from trainyard_api.context import ApiContext
from trainyard_api.dashboard import install_dashboard
from trainyard_api.deps import one_value_per_query_parameter
from trainyard_api.http_errors import install_error_handlers
from trainyard_api.routes import (
    audit,
    cluster,
    code,
    dashboard,
    datasets,
    experiments,
    goodput,
    jobs,
    lab,
    nodes,
    operations,
    plan,
    registry,
    tenants,
    triggers,
    whoami,
)
from trainyard_api.telemetry import TelemetryMiddleware

__all__ = ["DESCRIPTION", "TAGS", "ApiContext", "create_app"]

DESCRIPTION = """\
Submit, watch and control LLM training jobs on trainyard.

* A job is an immutable **TrainingSpec** (camelCase JSON, see `examples/tiny.yaml`).
  `POST /v1/training-jobs` validates it, stores it and answers `202` with the job id and
  the spec hash (sha256 of the canonical JSON, defaults filled in). A new configuration
  is a new job: there is no PATCH.
* Every route except `/healthz` needs `Authorization: Bearer <token>` (`/metrics`: a platform-admin token or
  the metrics token, `TRAINYARD_API_METRICS_TOKEN`, since it names tenants and jobs). The events trainyard
  publishes and consumes are described by `/v1/asyncapi.yaml` (and `.json`, AsyncAPI 3.0; no token either).
  A tenant sees only its own jobs, checkpoints and artifacts. The local stack (`make up`)
  writes a development token to `.trainyard/dev-token`.
* A token has a role: `viewer` (read the tenant's jobs, artifacts, metrics, triggers), `submitter` (+ submit,
  pause, resume, cancel, upload code, create and delete triggers), `tenant-admin` (+ the tenant's tokens and
  audit log), `platform-admin` (everything, every tenant: tenants, quotas, nodes). A token that is unknown, revoked or expired gets `401`
  saying which; a role without the right (or another tenant's resource) gets `403` naming the role needed.
  See docs/tenants.md.
* Invalid input is a `422` whose `detail` lists every bad field by its dotted camelCase
  path, e.g. `{"detail": [{"field": "training.globalBatchSize", "message": "…"}]}`; query and
  path parameters keep their source (`query.limit`). Bodies are JSON with the types this document
  gives (`0` is not `false`, `"5"` is not `5`).
* `503` (with `Retry-After`) means the state store is unavailable, or this API process is overloaded (every
  connection to the state store busy), nothing else: retry.
* `OPTIONS` on a path answers `204` with `Allow` listing its methods; a method the path does not
  have answers `405` with the same `Allow`.
"""  # noqa: E501 - the OpenAPI description, as served

TAGS = [
    {"name": "jobs", "description": "Submit training jobs, follow their progress, cancel, pause and resume them."},
    {"name": "triggers", "description": "Data lands, training starts: a trigger submits a job from its template "
                                        "for each new verified version of a dataset whose name matches (see "
                                        "docs/triggers.md)."},
    {"name": "experiments", "description": "Sweeps over a base spec: each trial an ordinary job, the losers stopped "
                                           "early by successive halving, the best trial and its checkpoint named "
                                           "(see docs/experiments.md)."},
    {"name": "registry", "description": "Artifacts (READY checkpoints, final models, exports) with their lineage; "
                                        "exporting a checkpoint as a Hugging Face model directory."},
    {"name": "datasets", "description": "Dataset versions published to the registry (`name@version`)."},
    {"name": "code", "description": "Users' training code, pinned by content: `.tar.gz` archives named by their "
                                  "sha256 (`trainyard submit --code DIR` uploads them); a job names one in "
                                  "`code.archive`, or gives `code.repo` + `code.revision`."},
    {"name": "planning", "description": "Capacity planning: memory per device, step time, communication, "
                                        "pipeline bubble, checkpoint interval, ranked layouts; calibrated per "
                                        "device type by what the platform measured."},
    {"name": "lab", "description": "The dashboard's Lab on the planner's own numbers: memory per device against "
                                   "model size, scaling across nodes against interconnect bandwidth, the "
                                   "checkpoint interval's redo against overhead."},
    {"name": "goodput", "description": "Allocated vs productive vs wasted device-time (lost work, launch and "
                                       "restore, checkpoint stalls, hangs, idle), per tenant."},
    {"name": "admin", "description": "Administration: tenants (quotas, priority), their tokens (roles, expiry, "
                                     "revocation), the audit log; node inventory, quarantine, drain and "
                                     "reputation (platform-admin)."},
    {"name": "operations", "description": "Health and Prometheus metrics (including "
                                          "`trainyard_goodput_device_seconds{tenant,kind}`); no authentication."},
]


ROUTERS = (jobs, plan, lab, goodput, nodes, code, triggers, experiments, tenants, audit, whoami, registry, datasets,
           operations, dashboard, cluster)

def create_app(context: ApiContext) -> FastAPI:
    """The REST API over ``context``: its routers in the order their paths are matched (and documented).

    ``/docs`` (Swagger UI) and ``/redoc`` load their scripts and styles from the API itself (fastapi-offline
    ships them, under ``/static-offline-docs``), never from a CDN: on a cluster without internet they work
    too. Swagger UI's online validator badge (a request to validator.swagger.io) is off."""
    app = FastAPIOffline(
        title="trainyard API",
        version="1.0.0",
        description=DESCRIPTION,
        openapi_tags=TAGS,
        dependencies=[Depends(one_value_per_query_parameter)],
        swagger_ui_parameters={"validatorUrl": None},
    )
    app.state.context = context
    app.add_middleware(TelemetryMiddleware)
    install_error_handlers(app)
    for routes in ROUTERS:  # in this order: FastAPI matches paths in the order they were added
        app.include_router(routes.router)
    install_dashboard(app)
    return app
