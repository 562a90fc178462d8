"""The shared models as request bodies take them: the same fields, with every bound the API enforces
stated on the field, so that validation and the OpenAPI document are one thing.

``TrainingSpec`` (trainyard_contract) checks in a model validator that a string ``modelConfig`` is a
catalog reference; here the string carries the pattern. Its seed may reach 2**63, past what JSON
carries exactly in most implementations (and past what schema validators compare exactly); here it
stops at 2**53 - 1. ``ModelConfig`` and the planner's models leave some numbers unbounded; here each
has a range inside which the planner's arithmetic stays finite and its enumeration of layouts small. Each class is its
parent with narrower fields, so everything downstream takes it as the parent.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.experiments import ExperimentSpec
from trainyard_contract.records import TokenRole, TriggerOn, TriggerSource
from trainyard_contract.spec import REF_PATTERN, Code, Training, TrainingSpec
from trainyard_planner import BytesPerParameter, DeviceSpec, Layout

MAX_SAFE_INTEGER = 2**53 - 1
"""Largest integer every JSON implementation carries exactly (I-JSON, RFC 7493): the bound of a seed."""
MAX_DEVICES = 65_536
"""Most devices one job or plan may name (``resources.gpuCount`` has the same bound)."""
MAX_BATCH = 2**24
"""Most sequences per step, micro-batches per step, or sequences per micro-batch."""
MAX_FLOPS = 1e21
"""Peak FLOP/s of one device (a thousand times an H100's)."""
MAX_BYTES = 1e18
"""Bytes of memory, of a checkpoint, or per second of a link."""

CatalogRef = Annotated[str, Field(pattern=REF_PATTERN, max_length=128, examples=["gpt-tiny@v1"])]


class BoundedModelConfig(ModelConfig):
    """An inline model."""

    d_ff: Annotated[int | None, Field(le=16 * 65_536)] = ModelConfig.model_fields["d_ff"]  # type: ignore[assignment]  # the parent's field, narrowed


class SubmittedTraining(Training):
    """How to train: steps, batch, optimizer, schedule."""

    seed: int = Field(default=0, ge=0, le=MAX_SAFE_INTEGER)


ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


def _env_schema(schema: dict[str, Any]) -> None:
    """``code.env`` as what it is: every name matches the pattern and every value is a string (pydantic
    states the pattern as ``patternProperties``, which lets any other name hold any value)."""
    value = schema.pop("patternProperties", {}).get(ENV_NAME_PATTERN, {"type": "string"})
    schema["propertyNames"] = {**schema.get("propertyNames", {}), "pattern": ENV_NAME_PATTERN}
    schema["additionalProperties"] = value


class SubmittedCode(Code):
    """The user's training code, pinned by content (see `PUT /v1/code/{archive}`): `archive`, or `repo` +
    `revision`, which the API resolves to `commit` and archives at submission."""

    env: dict[Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=256)],
              Annotated[str, Field(max_length=65_536)]] = Field(
        default={}, max_length=256, exclude_if=lambda v: not v, json_schema_extra=_env_schema,
        description=Code.model_fields["env"].description)


class SubmittedSpec(TrainingSpec):
    """A TrainingSpec as ``POST /v1/training-jobs`` takes it (the same JSON, the same hash)."""

    code: SubmittedCode | None = Field(
        default=None, exclude_if=lambda v: v is None, description=TrainingSpec.model_fields["code"].description)

    model_config_ref: Annotated[CatalogRef | BoundedModelConfig, Field(
        alias="modelConfig", description="catalog reference name@version, or an inline model")]
    training: SubmittedTraining


TEMPLATE_DATASET = "trigger-template@placeholder"
"""The dataset a trigger's template is checked with: never looked up (each new version fills it in)."""


class SpecTemplate(SubmittedSpec):
    """A training spec without `dataset`: each new dataset version a trigger matches fills it in."""

    dataset: SkipJsonSchema[str] = Field(default=TEMPLATE_DATASET, exclude=True)

    @field_validator("dataset")
    @classmethod
    def _no_dataset(cls, value: str) -> str:
        raise PydanticCustomError("template_dataset", "a template names no dataset: each new version the trigger "
                                                      "matches fills it in (give the names to match in `dataset` "
                                                      "of the trigger)")

    def wire_template(self) -> dict[str, Any]:
        """The template as stored: camelCase JSON data, defaults filled in, without dataset."""
        return self.model_dump(mode="json", by_alias=True)


class PlanLayout(Layout):
    """A parallel layout; dp x tp x pp is the number of devices."""

    dp: Annotated[int, Field(le=MAX_DEVICES)] = Layout.model_fields["dp"]  # type: ignore[assignment]  # the parent's field, narrowed
    tp: Annotated[int, Field(le=MAX_DEVICES)] = Layout.model_fields["tp"]  # type: ignore[assignment]  # the parent's field, narrowed
    pp: Annotated[int, Field(le=MAX_DEVICES)] = Layout.model_fields["pp"]  # type: ignore[assignment]  # the parent's field, narrowed
    micro_batch: Annotated[int, Field(le=MAX_BATCH)] = Layout.model_fields["micro_batch"]  # type: ignore[assignment]  # the parent's field, narrowed
    microbatches: Annotated[int, Field(le=MAX_BATCH)] = Layout.model_fields["microbatches"]  # type: ignore[assignment]  # the parent's field, narrowed
    virtual_stages: Annotated[int, Field(le=512)] = Layout.model_fields["virtual_stages"]  # type: ignore[assignment]  # the parent's field, narrowed


class PlanDevice(DeviceSpec):
    """An accelerator given inline: peak, memory and link bandwidths (one direction)."""

    name: Annotated[str, Field(min_length=1, max_length=64)] = DeviceSpec.model_fields["name"]  # type: ignore[assignment]  # the parent's field, narrowed
    peak_flops: Annotated[float, Field(ge=1e6, le=MAX_FLOPS)] = DeviceSpec.model_fields["peak_flops"]  # type: ignore[assignment]  # the parent's field, narrowed
    memory_bytes: Annotated[float, Field(ge=1e6, le=MAX_BYTES)] = DeviceSpec.model_fields["memory_bytes"]  # type: ignore[assignment]  # the parent's field, narrowed
    nvlink_bandwidth: Annotated[float, Field(ge=1, le=MAX_BYTES)] = DeviceSpec.model_fields["nvlink_bandwidth"]  # type: ignore[assignment]  # the parent's field, narrowed
    network_bandwidth: Annotated[float, Field(ge=1, le=MAX_BYTES)] = DeviceSpec.model_fields["network_bandwidth"]  # type: ignore[assignment]  # the parent's field, narrowed
    nvlink_domain: Annotated[int, Field(le=MAX_DEVICES)] = DeviceSpec.model_fields["nvlink_domain"]  # type: ignore[assignment]  # the parent's field, narrowed


class PlanBytesPerParameter(BytesPerParameter):
    """Bytes of training state per parameter, by kind (at most 64 each)."""

    weights: Annotated[float, Field(le=64)] = BytesPerParameter.model_fields["weights"]  # type: ignore[assignment]  # the parent's field, narrowed
    gradients: Annotated[float, Field(le=64)] = BytesPerParameter.model_fields["gradients"]  # type: ignore[assignment]  # the parent's field, narrowed
    master_weights: Annotated[float, Field(le=64)] = BytesPerParameter.model_fields["master_weights"]  # type: ignore[assignment]  # the parent's field, narrowed
    optimizer_states: Annotated[float, Field(le=64)] = BytesPerParameter.model_fields["optimizer_states"]  # type: ignore[assignment]  # the parent's field, narrowed


# ----------------------------------------------------------------------------- tenant administration

TENANT_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
"""A tenant's name: lower-case letters, digits, '.', '_', '-'; it names directories of the artifact store."""
DEVICE_KIND_PATTERN = r"^(\*|[a-z0-9][a-z0-9._-]{0,63})$"
MAX_TOKEN_TTL_S = 10 * 365 * 86_400


class _AdminBody(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class QuotaBody(_AdminBody):
    """A tenant's quota of one device type (the scheduler's semantics: services/scheduler policy.py)."""

    guaranteed: int | None = Field(default=None, ge=0, le=MAX_DEVICES,
                                   description="devices reserved to the tenant; null = unlimited")
    borrow_limit: int | None = Field(default=None, ge=0, le=MAX_DEVICES,
                                     description="devices above `guaranteed` it may borrow; null = no limit")


def _closed_quota_keys(schema: dict[str, Any]) -> None:
    """``quotas`` takes only device-type keys: say so (pydantic states the key pattern, not that others are
    refused)."""
    for branch in schema.get("properties", {}).get("quotas", {}).get("anyOf", []):
        if branch.get("type") == "object":
            branch["additionalProperties"] = False


class TenantSettingsBody(_AdminBody):
    """A tenant's queue settings. In a PATCH every field is optional and only the fields sent change; a quota
    set to `null` is removed (the tenant falls back to its `*` quota, then to unlimited)."""

    model_config = ConfigDict(json_schema_extra=_closed_quota_keys)

    cohort: str | None = Field(default=None, pattern=TENANT_PATTERN,
                               description="tenants of one cohort share the cohort's limits (default `default`)")
    weight: float | None = Field(default=None, gt=0, le=1000, description="fair-share weight (default 1)")
    max_priority: int | None = Field(
        default=None, ge=-1000, le=1000,
        description="its jobs' spec.priority is lowered to this, so its jobs reach no higher priority class "
                    "(null: no cap)")
    quotas: dict[Annotated[str, Field(pattern=DEVICE_KIND_PATTERN)], QuotaBody | None] | None = Field(
        default=None, max_length=64, description="device type (or `*`: every other type) → quota",
        examples=[{"cpu": {"guaranteed": 8, "borrowLimit": 4}, "*": {"guaranteed": 0}}])


class TenantCreateBody(TenantSettingsBody):
    tenant: str = Field(pattern=TENANT_PATTERN, description="the new tenant's name", examples=["research"])


class DatasetPublishBody(_AdminBody):
    """A version of the caller's tenant whose files are in place under its prefix
    (``tenants/<tenant>/datasets/<name>/<version>/``, e.g. by ``trainyard datasets import``)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", examples=["wiki-en"])
    version: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                         examples=["2026-12-01"])
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of its manifest.json")
    shared_with: list[Annotated[str, Field(pattern=r"^(\*|[a-z0-9][a-z0-9._-]{0,62})$")]] = Field(
        default=[], max_length=256, description='other tenants that may train on it; ["*"]: every tenant')
    tokenizer: str | None = Field(default=None, max_length=256)
    num_tokens: int | None = Field(default=None, ge=0, le=MAX_SAFE_INTEGER)


class ExportBody(_AdminBody):
    """What to convert a checkpoint into."""

    format: Literal["hf"] = Field(description="hf: a Hugging Face model directory (config.json, model.safetensors, "
                                              "tokenizer.json) that transformers' from_pretrained loads")


class TokenCreateBody(_AdminBody):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._@-]*$",
                      description="a label (shown as submittedBy and in the audit log)", examples=["ci-pipeline"])
    role: TokenRole = Field(default="submitter", description="viewer, submitter, tenant-admin or platform-admin")
    expires_at: datetime | None = Field(default=None, description="refused from this instant on (RFC 3339, with "
                                                                  "offset); give this or ttlSeconds, not both")
    ttl_seconds: int | None = Field(default=None, gt=0, le=MAX_TOKEN_TTL_S,
                                    description="refused this many seconds after creation")

    @field_validator("expires_at")
    @classmethod
    def _with_offset(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise PydanticCustomError("expiry_offset", "needs a UTC offset (e.g. 2027-01-01T00:00:00Z)")
        return value

    @field_validator("ttl_seconds")
    @classmethod
    def _one_expiry(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("expires_at") is not None:
            raise PydanticCustomError("one_expiry", "give expiresAt or ttlSeconds, not both")
        return value


# ----------------------------------------------------------------------------- triggers

TRIGGER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DATASET_GLOB_PATTERN = r"^[A-Za-z0-9._*?!\[\]-]{1,128}$"
"""A glob over dataset names (``*``, ``?``, ``[abc]``, ``[!abc]``), e.g. ``wiki-*``."""


class TriggerCreateBody(_AdminBody):
    name: str = Field(pattern=TRIGGER_NAME_PATTERN, description="unique within the tenant",
                      examples=["wiki-nightly"])
    on: TriggerOn = Field(default="datasetVersion", description="`datasetVersion` (each new verified version of a "
                                                                 "matching dataset) or `checkpointReady` (each READY "
                                                                 "checkpoint of `job` or of `experiment`'s jobs)")
    dataset: str | None = Field(default=None, pattern=DATASET_GLOB_PATTERN,
                                description="a glob over dataset names: each new verified version of a matching "
                                            "dataset submits a job (`on: datasetVersion`)", examples=["wiki-*"])
    job: str | None = Field(default=None, min_length=1, max_length=128,
                            description="`on: checkpointReady`: the job whose READY checkpoints it evaluates")
    experiment: str | None = Field(default=None, min_length=1, max_length=128,
                                   description="`on: checkpointReady`: the experiment whose jobs' READY checkpoints "
                                               "it evaluates")
    every_steps: int | None = Field(default=None, ge=1, le=1_000_000_000,
                                    description="`on: checkpointReady`: only checkpoints whose step is a multiple of "
                                                "it (unset: every READY checkpoint)")
    sources: list[TriggerSource] = Field(
        default=["own"], min_length=1, max_length=3,
        description="whose datasets: `own` (the tenant's), `platform` (the platform's, no tenant), `shared` "
                    "(other tenants' shared with this one)")
    template: SpecTemplate = Field(description="the job to submit: a training spec without `dataset` (`on: "
                                               "checkpointReady`: with `evaluation`, without `initFrom`)")
    enabled: bool = Field(default=True, description="false: the trigger is kept but starts nothing")


class ExperimentBody(ExperimentSpec):
    """``POST /v1/experiments``: an experiment whose base is checked as ``POST /v1/training-jobs`` checks a spec."""

    base: SubmittedSpec = Field(  # type: ignore[assignment]  # the spec, checked as a submission (wire: a dict)
        description="a complete training spec (the POST /v1/training-jobs body): every "
                                            "trial is this spec with its point of the search space written in")

    def experiment_spec(self) -> ExperimentSpec:
        data = self.model_dump(mode="json", by_alias=True, exclude={"base"})
        return ExperimentSpec.model_validate({**data, "base": self.base.wire()})
