"""trainyard_api: the REST API (submission, auth, job read models, registry queries, capacity planning
calibrated by the platform's measurements): commands and queries; the StepMetrics read models it serves are
kept by the telemetry service (``trainyard_telemetry``).

``ApiServer(settings)`` runs it (uvicorn + ServiceRuntime in one process);
``create_app(ApiContext(...))`` gives the bare FastAPI app (tests, embedding).
"""

from trainyard_api.app import ApiContext, create_app
from trainyard_api.auth import issue_token
from trainyard_api.jobs import JobService, Submission, new_job_id
from trainyard_api.planning import MemoryCheck, PlanRequest, PlanResponse, check_spec_memory, plan
from trainyard_api.server import ApiServer, bind_socket
from trainyard_api.settings import ApiSettings
from trainyard_api.validation import FieldProblem, InvalidSpecError, check_references, field_errors

__all__ = [
    "ApiContext",
    "ApiServer",
    "ApiSettings",
    "FieldProblem",
    "InvalidSpecError",
    "JobService",
    "MemoryCheck",
    "PlanRequest",
    "PlanResponse",
    "Submission",
    "bind_socket",
    "check_references",
    "check_spec_memory",
    "create_app",
    "field_errors",
    "issue_token",
    "new_job_id",
    "plan",
]
