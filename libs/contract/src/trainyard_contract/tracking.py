"""Where a job's curves go besides trainyard's own dashboard: a tenant's tracking targets (docs/tracking.md).

A tenant's targets are a platform-admin setting (``PUT /v1/admin/tenants/{tenant}/tracking``, Redis
``ty:tracking:tenants``): the MLflow tracking server the telemetry service sends the tenant's jobs to, and whether
TensorBoard event files are written into each job's directory. The MLflow URI is egress from the control plane, so
no tenant names one: a job's spec only opts in or out of what its tenant has (``TrainingSpec.tracking``).

:func:`mlflow_uri_problem` is the one check of a URI, made where it is set (a 422 naming ``mlflowUri``) and again
where it is used (the exporter refuses a stored URI that no longer passes).
"""

from __future__ import annotations

import ipaddress
from datetime import datetime
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

from trainyard_contract.records import Record

__all__ = ["MlflowUri", "TenantTracking", "checked_mlflow_uri", "mlflow_uri_problem"]

MAX_URI_LENGTH = 2048
# names that cloud providers' instance metadata services answer on (an IP literal is caught by its range)
_METADATA_HOSTS = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                             "instance-data.ec2.internal", "metadata.azure.internal"})


def _address_problem(host: str) -> str | None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_link_local:
        return f"{host} is link-local (a cloud metadata address): refused"
    if address.is_multicast or address.is_unspecified or address.is_reserved:
        return f"{host} is not a unicast host address"
    if str(address) == "fd00:ec2::254":
        return f"{host} is a cloud metadata address: refused"
    return None


def mlflow_uri_problem(uri: str) -> str | None:
    """Why ``uri`` is not an MLflow tracking URI the platform will call (None: it is): ``http(s)://host[:port]
    [/path]`` only, no credentials in it (a tenant-admin reads it back), no query or fragment, and not a link-local
    or cloud-metadata host. A loopback or private host is allowed: the platform-admin who sets it runs the network."""
    if len(uri) > MAX_URI_LENGTH:
        return f"at most {MAX_URI_LENGTH} characters"
    if any(c.isspace() or ord(c) < 0x20 for c in uri):
        return "no whitespace or control characters"
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError as exc:
        return f"not a URL: {exc}"
    if parts.scheme not in ("http", "https"):
        return "scheme must be http or https (an MLflow tracking server's REST API)"
    if not parts.hostname:
        return "name a host: http(s)://host[:port][/path]"
    if parts.username is not None or parts.password is not None:
        return "no credentials in the URI: it is shown to the tenant's admins"
    if parts.query or parts.fragment:
        return "no query or fragment"
    if port == 0:
        return "port 0 is not a port"
    host = parts.hostname.rstrip(".").lower()
    if host in _METADATA_HOSTS:
        return f"{host} is a cloud metadata host: refused"
    return _address_problem(host)


def checked_mlflow_uri(value: str) -> str:
    """``value`` when it is a URI the exporter may call (:func:`mlflow_uri_problem`), else ValueError saying why."""
    if problem := mlflow_uri_problem(value):
        raise ValueError(problem)
    return value


MlflowUri = Annotated[str, AfterValidator(checked_mlflow_uri)]
"""A tenant's MLflow tracking server, checked wherever one is taken in (the admin body, the stored record)."""


class TenantTracking(Record):
    """A tenant's tracking targets (``ty:tracking:tenants``, field: the tenant), set by a platform-admin."""

    mlflow_uri: MlflowUri | None = Field(
        default=None, description="the MLflow tracking server (http(s)://host[:port]); null: no MLflow export")
    tensorboard: bool = Field(default=False, description="write TensorBoard event files into each job's directory")
    updated_at: datetime | None = None
    updated_by: str | None = Field(default=None, description="the token id that set it")
