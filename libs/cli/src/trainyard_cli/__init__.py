"""trainyard_cli: the ``trainyard`` command line and a typed client of the REST API.

``ApiClient`` / ``AsyncApiClient`` talk to the API; ``follow_job`` shows a job's progress
until it ends and returns the exit code.
"""

from trainyard_cli.client import (
    ApiAuthError,
    ApiClient,
    ApiConflictError,
    ApiError,
    ApiNotFoundError,
    ApiSpecError,
    ApiUnreachableError,
    AsyncApiClient,
    Job,
)
from trainyard_cli.config import CliConfig, resolve_api_url, resolve_token
from trainyard_cli.follow import follow_job

__all__ = [
    "ApiAuthError",
    "ApiClient",
    "ApiConflictError",
    "ApiError",
    "ApiNotFoundError",
    "ApiSpecError",
    "ApiUnreachableError",
    "AsyncApiClient",
    "CliConfig",
    "Job",
    "follow_job",
    "resolve_api_url",
    "resolve_token",
]
