"""The ``lab`` routes: the dashboard's Lab on the planner's own numbers (the routes themselves are
:func:`trainyard_api.lab.install_lab_routes`'s; this module gives them their dependencies)."""

from __future__ import annotations

from fastapi import APIRouter

from trainyard_api.context import context_of
from trainyard_api.deps import may, strict_body
from trainyard_api.http_errors import AUTH_ERRORS, NOT_JSON, invalid
from trainyard_api.lab import install_lab_routes
from trainyard_api.roles import Right

router = APIRouter()

install_lab_routes(
    router,  # type: ignore[arg-type]  # it needs only the route decorators an APIRouter has too
    read=may(Right.READ), strict_body=strict_body,
    responses={**AUTH_ERRORS, **NOT_JSON, **invalid("invalid input, each problem named by field; also an unknown model "
                                                    "or device, or a tensor degree the node or the model's heads "
                                                    "cannot be split by")},
    assumptions=lambda r: context_of(r).settings.assumptions)
