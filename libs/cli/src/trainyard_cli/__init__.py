"""trainyard_cli: the ``trainyard`` command line and a typed client of the REST API.

``ApiClient`` / ``AsyncApiClient`` talk to the API; ``follow_job`` shows a job's progress
until it ends and returns the exit code. The names are imported when first used (PEP 562), so
``import trainyard_cli.main`` — every command's start — does not import httpx and the API's models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_WHERE = {
    **dict.fromkeys(("ApiAuthError", "ApiClient", "ApiConflictError", "ApiError", "ApiNotFoundError", "ApiSpecError",
                     "ApiUnreachableError", "AsyncApiClient", "Job"), "trainyard_cli.client"),
    **dict.fromkeys(("CliConfig", "resolve_api_url", "resolve_token"), "trainyard_cli.config"),
    "follow_job": "trainyard_cli.follow",
}

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'trainyard_cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
