"""Typed settings, parsed once in each service's ``main()`` from ``TRAINYARD_*`` variables.

Each service subclasses :class:`ServiceSettings` with its own fields. Nothing deeper in
the code reads ``os.environ``; the settings object is passed down.

A setting has one name per meaning. When one is renamed, its old variable stays accepted for a while: the
class lists it in ``renamed_env``, and parsing takes its value with a warning (a ``FutureWarning``, the category
Python shows operators by default) unless the new variable is set.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainyard_contract.errors import ConfigError
from trainyard_contract.storage import as_location, root_setting

S = TypeVar("S", bound=BaseSettings)


class ServiceSettings(BaseSettings):
    """What every trainyard process needs: where the broker, Redis and artifacts are."""

    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", extra="ignore")

    kafka_bootstrap: str = Field(default="127.0.0.1:9092", description="host:port[,host:port]")
    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = Field(
        default="PLAINTEXT", description="how to reach the broker: SASL_SSL (or SASL_PLAINTEXT on a private network) "
                                         "with a user per service in production")
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "SCRAM-SHA-512"
    kafka_sasl_username: str | None = Field(default=None, description="this service's broker user (SASL)")
    kafka_sasl_password: SecretStr | None = Field(default=None, description="its password (SASL)")
    kafka_ssl_cafile: Path | None = Field(default=None, description="CA bundle for SSL / SASL_SSL")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0",
                           description="redis://[user:password@]host:port/db: an ACL user per service in production; "
                                       "or redis+sentinel://[user:password@]host:port[,host:port…]/service[/db] "
                                       "to follow a primary that Sentinel fails over (epoch increments then "
                                       "wait for a replica: ?epoch_acks=1&epoch_ack_timeout_ms=1000, the "
                                       "defaults; see docs/production.md)")
    artifact_root: Path | str = Field(
        default=Path(".trainyard/artifacts"),
        description="a directory (local, or a shared filesystem), or an fsspec URL of an object store "
                    "(s3://bucket/prefix with s3fs; credentials and endpoint from the standard AWS/fsspec "
                    "configuration)")
    topic_partitions: int = Field(default=3, gt=0)
    topic_replication: int = Field(default=1, gt=0)
    create_topics: bool = Field(default=True, description="create missing topics at start-up")
    group_prefix: str = "trainyard"
    topic_namespace: str = Field(default="", description="prefix of every topic name; empty in production")
    instance_id: str | None = Field(default=None, description="defaults to host:pid")
    log_level: str = "INFO"
    metrics_port: int | None = Field(default=None, ge=0, lt=65536, description="Prometheus /metrics")
    metrics_addr: str = Field(default="0.0.0.0", description="the address the metrics port listens on")  # noqa: S104 - a scraper reaches it from another host
    metrics_token: SecretStr | None = Field(
        default=None, description="a bearer token the metrics port requires (its series name tenants and jobs); "
                                  "without one it answers whoever reaches it")
    health_interval_s: float = Field(default=2.0, gt=0)
    consumer_session_timeout_ms: int = Field(
        default=6000, ge=1000, description="Kafka consumer session timeout; a dead consumer's partitions move after it"
    )
    consumer_fetch_max_wait_ms: int = Field(
        default=500, ge=1, le=30_000,
        description="how long a consumer's fetch waits for records when there are none. Apache Kafka answers a "
                    "waiting fetch as soon as a record arrives, so this only paces idle polling; the embedded local "
                    "broker (tansu) answers at the end of the wait, so there it is the latency of every event hop "
                    "(the local stack sets 20)")
    consumer_background_fetch_max_wait_ms: int = Field(
        default=500, ge=1, le=30_000,
        description="the same for consumers nobody waits on (metrics, the registry's records, triggers, the "
                    "dashboard's live feed): on the embedded broker a longer wait polls less when idle (the local "
                    "stack sets 250)")
    consumer_idle_pause_s: float | None = Field(
        default=None, ge=0.5,
        description="pause an idle consumer's fetching after this many seconds without a record; a doorbell "
                    "(a Redis PUBLISH by trainyard's producers) or the poll below wakes it "
                    "(trainyard_runtime.idlefetch). "
                    "Off by default (Apache Kafka answers a waiting fetch when a record arrives); the local stack sets "
                    "it (0.5), since the embedded broker answers only at the end of each wait; at least twice the "
                    "doorbell's coalescing (0.25 s)")
    consumer_idle_poll_s: float = Field(
        default=5.0, gt=0, description="how often a paused idle consumer fetches anyway (a record from a producer "
                                       "without a doorbell waits at most this long)")
    reconcile_interval_s: float = Field(default=5.0, gt=0)

    #: Old variable (full name) -> the field it sets now; read with a FutureWarning (see the module docstring).
    renamed_env: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _renamed_variables(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        prefix = str(cls.model_config.get("env_prefix", ""))
        for old, field in cls.renamed_env.items():
            if old not in os.environ:
                continue
            if field not in data:  # set, the new name wins (the old one may be another service's setting)
                warnings.warn(f"{old} is deprecated: {cls.__name__} reads it as {prefix}{field.upper()}; set that "
                              "instead", FutureWarning, stacklevel=2)
                data = {**data, field: os.environ[old]}
        return data

    @field_validator("artifact_root", mode="before")
    @classmethod
    def _root_is_a_path_or_a_url(cls, value: object) -> object:
        return root_setting(value)

    @property
    def artifact_root_abs(self) -> Any:
        """The root as a location: an absolute Path, or an ObjectPath for an object store."""
        return as_location(self.artifact_root)

    @property
    def artifact_root_is_remote(self) -> bool:
        return isinstance(self.artifact_root, str)

    @model_validator(mode="after")
    def _sasl_needs_a_user(self) -> ServiceSettings:
        sasl = self.kafka_security_protocol.startswith("SASL")
        if sasl and not (self.kafka_sasl_username and self.kafka_sasl_password):
            raise ValueError(f"TRAINYARD_KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} needs "
                             "TRAINYARD_KAFKA_SASL_USERNAME and TRAINYARD_KAFKA_SASL_PASSWORD")
        return self


def redacted(url: str) -> str:
    """``url`` without its password (for logs and errors): redis://user:***@host:port/0."""
    parts = urlsplit(url)
    if "password=" in parts.query:  # a Sentinel's own (?sentinel_password=…)
        query = "&".join(f"{k}=***" if k.endswith("password") else f"{k}={v}"
                         for k, _, v in (p.partition("=") for p in parts.query.split("&")))
        parts = parts._replace(query=query)
    if parts.password is None:
        return urlunsplit(parts)
    hosts = parts.netloc.rpartition("@")[2]  # as written: a Sentinel URL names several host:port
    netloc = f"{parts.username or ''}:***@{hosts}"
    return urlunsplit(parts._replace(netloc=netloc))


def load_settings(cls: type[S], **overrides: object) -> S:
    """Parse settings once; a bad variable becomes a ConfigError naming it."""
    try:
        return cls(**overrides)  # type: ignore[arg-type]  # any subclass's fields, checked by pydantic
    except ValidationError as exc:
        prefix = cls.model_config.get("env_prefix", "")
        problems = "; ".join(
            (f"{prefix}{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" if e["loc"]
             else str(e["msg"]).removeprefix("Value error, ")) for e in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from exc



def settings_env(settings: BaseSettings) -> dict[str, str]:
    """``settings`` as the environment variables that parse back to it (for a child process of the service)."""
    import json

    prefix = settings.model_config.get("env_prefix", "")
    out = {}
    for name, value in settings.model_dump(mode="json").items():
        raw = getattr(settings, name)
        if isinstance(raw, SecretStr):
            value = raw.get_secret_value()
        if value is None:
            continue
        out[f"{prefix}{name}".upper()] = value if isinstance(value, str) else json.dumps(value)
    return out


def settings_help(cls: type[BaseSettings]) -> str:
    """Every variable of ``cls``: name, default and meaning — the body of a service's ``--help``."""
    import textwrap

    prefix = cls.model_config.get("env_prefix", "")
    lines = ["configuration (environment variables):"]
    for name, info in cls.model_fields.items():
        default = "required" if info.is_required() else f"default: {info.get_default(call_default_factory=True)!s}"
        lines.append(f"  {prefix}{name.upper()}  ({default})")
        if info.description:
            lines.extend(textwrap.wrap(info.description, 76, initial_indent="      ", subsequent_indent="      "))
    for old, field in getattr(cls, "renamed_env", {}).items():
        lines.append(f"  {old}  (deprecated: {prefix}{field.upper()})")
    lines += [
        "  OTEL_EXPORTER_OTLP_ENDPOINT",
        "      traces are exported there over OTLP (e.g. Jaeger) when set; other OTEL_* variables apply",
        "",
        "The service stops cleanly on SIGTERM or SIGINT.",
    ]
    return "\n".join(lines)
