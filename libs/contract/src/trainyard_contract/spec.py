"""The immutable training spec (`POST /v1/training-jobs` body) and its canonical hash.

Field names on the wire are camelCase, as in the seed; Python attributes are snake_case.
Validation here is everything that can be checked without I/O. References to the model
catalog and the dataset registry are resolved by the caller.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from trainyard_contract.catalog import ModelConfig

REF_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9._-]*$"
DATASET_REF_PATTERN = r"^(?:[a-z0-9][a-z0-9._-]{0,62}/)?[A-Za-z0-9][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9._-]*$"
"""A dataset version: ``name@version`` (the submitter's own, else the platform's) or
``tenant/name@version`` (that tenant's, which it owns or that is shared with it)."""


class DatasetRef(NamedTuple):
    """A parsed dataset reference; ``tenant`` None is unqualified (or the platform's)."""

    tenant: str | None
    name: str
    version: str

    @classmethod
    def parse(cls, ref: str) -> DatasetRef:
        if not re.match(DATASET_REF_PATTERN, ref):
            raise ValueError(f"not a dataset reference (name@version or tenant/name@version): {ref!r}")
        owner, _, rest = ref.rpartition("/")
        name, _, version = rest.partition("@")
        return cls(owner or None, name, version)

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name}@{self.version}" if self.tenant else f"{self.name}@{self.version}"


class _Wire(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, frozen=True, extra="forbid",
        protected_namespaces=(),
    )


class Resources(_Wire):
    gpu_type: str = Field(min_length=1, max_length=64, description="device type, e.g. h100-80gb or cpu")
    gpu_count: int = Field(gt=0, le=65_536)
    topology: str | None = Field(default=None, max_length=64)
    expected_duration_minutes: float | None = Field(
        default=None, gt=0, le=525_600,
        # came later: left out of the wire form when unset, so every earlier spec keeps its hash
        exclude_if=lambda v: v is None,
        description="the job's expected run time; used only by backfill (a job may start on devices held "
                    "for the head of the queue if it ends before the head's reserved start)",
    )


class Parallelism(_Wire):
    data: int = Field(default=1, gt=0)
    tensor: int = Field(default=1, gt=0)
    pipeline: int = Field(default=1, gt=0)

    @property
    def world_size(self) -> int:
        return self.data * self.tensor * self.pipeline


class CheckpointPolicy(_Wire):
    every_steps: int | None = Field(default=None, gt=0)
    every_minutes: float | None = Field(default=None, gt=0)
    keep_last: int = Field(default=3, gt=0, le=1000)
    mode: Literal["async", "sync"] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="async (default): training continues while shards are written; sync: it waits",
    )
    auto: bool = Field(
        default=False,
        # auto came later: leaving it out of the wire form when false keeps every earlier spec's hash.
        exclude_if=lambda auto: not auto,
        description="checkpoint at the Young/Daly interval the platform measures (write time, stall, "
                    "MTBF); everySteps/everyMinutes, if given, is the interval until it has measured",
    )

    @model_validator(mode="after")
    def _exactly_one_interval(self) -> CheckpointPolicy:
        both = self.every_steps is not None and self.every_minutes is not None
        if self.auto and both:
            raise ValueError("with auto, set at most one of everySteps or everyMinutes (the starting interval)")
        if not self.auto and (self.every_steps is None) == (self.every_minutes is None):
            raise ValueError("set exactly one of everySteps or everyMinutes, or auto: true")
        return self


class Optimizer(_Wire):
    name: Literal["adamw", "sgd"] = "adamw"
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)


class LrSchedule(_Wire):
    name: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)


class Training(_Wire):
    seed: int = Field(default=0, ge=0, lt=2**63)
    sequence_length: int = Field(gt=0, le=1_048_576)
    micro_batch_size: int = Field(gt=0, le=65_536)
    global_batch_size: int = Field(gt=0, description="sequences per optimizer step")
    optimizer: Optimizer = Optimizer()
    learning_rate: float = Field(gt=0, lt=10)
    lr_schedule: LrSchedule = LrSchedule()
    max_steps: int = Field(gt=0, le=10_000_000)
    grad_clip: float | None = Field(default=1.0, gt=0)
    deterministic: bool = True
    # Added after v1 shipped: left out of the wire form when unset, so earlier specs keep their hash.
    sharding: Literal["ddp", "zero1", "zero2", "fsdp"] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="data-parallel sharding: ddp (default), zero1, zero2, fsdp (ZeRO-3)",
    )
    activation_checkpointing: bool | None = Field(
        default=None, exclude_if=lambda v: v is None, description="recompute each block's activations in backward"
    )
    precision: Literal["auto", "bf16", "fp32"] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="auto: bf16 autocast on CUDA devices that support it, fp32 on CPU",
    )


def _unset(v: object) -> bool:
    return v is None


#: A Hugging Face model directory, relative to the tenant's prefix in the artifact store:
#: ``models/<name>`` (``trainyard models import``) or an export's ``jobs/<job>/exports/<checkpoint>/hf``.
#: (``.`` and ``..`` components are refused by the model's validator.)
HF_DIR_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+){0,15}$"


class InitFrom(_Wire):
    """Start a new job from trained weights: another job's READY checkpoint (``jobId``, optionally
    ``globalStep``) or a Hugging Face model directory (``huggingFace``: a GPT-2 or Llama directory of
    the caller's tenant, e.g. an export or one brought in with ``trainyard models import``). A new
    configuration is a new job, linked to the old one (there is no PATCH). Only the model weights are
    taken; the optimizer, schedule, data position and step counter start fresh under the new spec."""

    job_id: str | None = Field(default=None, min_length=1, max_length=128, exclude_if=_unset,
                               description="the earlier job (same tenant)")
    global_step: int | None = Field(
        default=None, ge=0, description="its READY checkpoint at this step; unset: its latest READY one")
    hugging_face: str | None = Field(
        default=None, max_length=512, pattern=HF_DIR_PATTERN, exclude_if=_unset,
        description="a Hugging Face model directory under your tenant's prefix: models/<name> "
                    "(trainyard models import) or an export's jobs/<job>/exports/<checkpoint>/hf",
    )

    @model_validator(mode="after")
    def _one_source(self) -> InitFrom:
        if (self.job_id is None) == (self.hugging_face is None):
            raise ValueError("initFrom names exactly one of jobId (a READY checkpoint) or huggingFace (a directory)")
        if self.hugging_face is not None and {".", ".."} & set(self.hugging_face.split("/")):
            raise ValueError("initFrom.huggingFace must stay inside your tenant's prefix (no . or .. components)")
        if self.hugging_face is not None and self.global_step is not None:
            raise ValueError("initFrom.globalStep goes with jobId, not huggingFace")
        return self


class Evaluation(_Wire):
    """Do not train: load the checkpoint ``initFrom`` names (``jobId`` and ``globalStep``) and evaluate it. The
    built-in trainer reports held-out loss and perplexity over ``batches`` batches (the same batches every time);
    user code reports its own numbers with ``run.report_evaluation``. The results are attached to that checkpoint
    in the registry (``GET /v1/training-jobs/{jobId}/evaluations`` of the trained job)."""

    batches: int = Field(default=8, ge=1, le=1024, description="held-out batches the built-in evaluator averages")


class Export(_Wire):
    """Convert the job's final checkpoint when it succeeds (``format: hf``: a Hugging Face model
    directory that ``transformers`` loads), recorded in the registry as an ``export`` artifact."""

    format: Literal["hf"] = Field(description="hf: config.json, model.safetensors, tokenizer files")


ARCHIVE_PATTERN = r"^sha256:[0-9a-f]{64}$"
COMMIT_PATTERN = r"^[0-9a-f]{40}([0-9a-f]{24})?$"


class Environment(_Wire):
    """The Python packages the code needs beyond the node's base (its torch and the trainyard SDK), pinned by
    content: a lock file inside the code tree (``requirements.txt`` with hashes, ``pylock.toml`` or ``uv.lock``),
    named by its path there and the sha256 of its bytes (filled in by the API at submission). The node builds it
    once per sha256 into its environment cache (see docs/sdk.md, "Your environment")."""

    lock: str = Field(min_length=1, max_length=1024,
                      description="path of the lock file inside the code tree: requirements.txt (with hashes), "
                                  "pylock.toml or uv.lock")
    sha256: str | None = Field(default=None, pattern=ARCHIVE_PATTERN, exclude_if=_unset,
                               description="sha256:<hex> of the lock file's bytes (the API fills it in at submission)")

    @model_validator(mode="after")
    def _inside_tree(self) -> Environment:
        if self.lock.startswith("/") or ".." in self.lock.split("/") or "\\" in self.lock:
            raise ValueError("code.environment.lock must be a relative path inside the code tree")
        return self


class Code(_Wire):
    """The user's training code, pinned by content: every attempt runs exactly this tree.

    Either ``archive`` (a tree uploaded with ``trainyard submit --code DIR``: the sha256 of its
    deterministic ``.tar.gz``) or ``repo`` + ``revision`` (a git URL or path; the API resolves the
    revision to a full ``commit`` at submission, archives that commit and fills in ``archive``).
    ``commit`` and ``dirty`` record the git state of an uploaded checkout (provenance only).
    Without ``code`` the built-in trainer runs.
    """

    archive: str | None = Field(default=None, pattern=ARCHIVE_PATTERN, exclude_if=_unset,
                                description="sha256:<hex> of the uploaded code archive (.tar.gz)")
    repo: str | None = Field(default=None, min_length=1, max_length=1024, exclude_if=_unset,
                             description="git URL or path, resolved and archived by the API at submission")
    revision: str | None = Field(default=None, min_length=1, max_length=256, exclude_if=_unset,
                                 description="commit, tag or branch of repo, as submitted")
    commit: str | None = Field(default=None, pattern=COMMIT_PATTERN, exclude_if=_unset,
                               description="the full git commit the tree is (resolved at submission)")
    dirty: bool | None = Field(default=None, exclude_if=_unset,
                               description="the uploaded checkout had uncommitted changes")
    entrypoint: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(
        min_length=1, max_length=256,
        description="the command each rank runs, in workingDir, e.g. [\"python\", \"train.py\", \"--lr\", \"3e-4\"]")
    working_dir: str | None = Field(default=None, min_length=1, max_length=1024, exclude_if=_unset,
                                    description="directory inside the tree the entrypoint runs in (default: its root)")
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)],
              Annotated[str, Field(max_length=65_536)]] = Field(
        default={}, max_length=256, exclude_if=lambda v: not v,
        description="extra environment of every rank (TRAINYARD_*, RANK, WORLD_SIZE, MASTER_* are the platform's)")
    image: str | None = Field(default=None, min_length=1, max_length=512, exclude_if=_unset,
                              description="container image the ranks run in (Kubernetes); recorded and shown")
    environment: Environment | None = Field(
        default=None, exclude_if=_unset,
        description="the packages the code needs beyond the node's base, pinned by a lock file in the tree")

    @model_validator(mode="after")
    def _one_source(self) -> Code:
        if self.repo is None and self.archive is None:
            raise ValueError("code needs archive (trainyard submit --code DIR) or repo + revision")
        if self.repo is not None and self.revision is None:
            raise ValueError("code.repo needs code.revision (a commit, tag or branch)")
        if self.repo is None and self.revision is not None:
            raise ValueError("code.revision needs code.repo")
        if self.working_dir is not None and (self.working_dir.startswith("/") or ".." in self.working_dir.split("/")):
            raise ValueError("code.workingDir must be a relative path inside the code tree")
        reserved = sorted(k for k in self.env if k.startswith("TRAINYARD_") or k in RESERVED_ENV)
        if reserved:
            raise ValueError(f"code.env must not set {', '.join(reserved)}: the platform sets them")
        return self


#: The rank environment contract the platform owns (code.env may not override it).
RESERVED_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "TRACEPARENT", "CUDA_VISIBLE_DEVICES"})


class FaultTolerance(_Wire):
    """Replicas that drop out and rejoin while the others keep stepping (torchft: a quorum per step, a
    returning replica healed live from a healthy peer). The data-parallel dimension is ``replicas`` replica
    groups of one rank each; while at least ``minReplicas`` of them step, a failed one is replaced without
    ending the attempt. Below it, the attempt ends the usual way and the next resumes from the latest READY
    checkpoint (see docs/failures.md, "A replica fails, training goes on")."""

    replicas: int = Field(ge=2, le=1024, description="replica groups (= parallelism.data)")
    min_replicas: int = Field(ge=1, le=1024, description="fewest replicas that may take a step; below it the "
                                                         "attempt ends and restarts from the latest READY checkpoint")
    batch: Literal["reduced", "accumulate"] = Field(
        default="reduced",
        description="a step with fewer replicas: reduced (the missing replicas' rows are skipped, the step's "
                    "batch is smaller) or accumulate (the replicas that step read the missing rows too, in more "
                    "micro-batches: the global batch is kept). The run record lists the steps with fewer replicas",
    )
    quorum_timeout_seconds: float = Field(
        default=60.0, gt=0, le=3600,
        description="how long a step waits for the quorum (and a replica's collectives for its peers) "
                    "before the replica that waits gives up",
    )

    @model_validator(mode="after")
    def _fewer_than_all(self) -> FaultTolerance:
        if self.min_replicas > self.replicas:
            raise ValueError(f"faultTolerance.minReplicas ({self.min_replicas}) must not exceed "
                             f"faultTolerance.replicas ({self.replicas})")
        return self


#: An MLflow experiment or run name a job may choose (the platform puts the tenant in front of an experiment's).
TRACKING_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._:/-]{0,127}$"


class Tracking(_Wire):
    """Which of its tenant's tracking targets a job's curves go to (docs/tracking.md). The targets themselves (the
    MLflow server, TensorBoard files) are the tenant's, set by a platform-admin: a job cannot name a URI."""

    mlflow: bool = Field(default=True, description="export to the tenant's MLflow server (if it has one)")
    tensorboard: bool = Field(default=True, description="write TensorBoard event files (if the tenant has them on)")
    run_name: str | None = Field(default=None, pattern=TRACKING_NAME_PATTERN, exclude_if=lambda v: v is None,
                                 description="the MLflow run's name (default: the job's name, else its id)")
    experiment_name: str | None = Field(
        default=None, pattern=TRACKING_NAME_PATTERN, exclude_if=lambda v: v is None,
        description="the MLflow experiment, under the tenant's prefix: `<tenant>/<experimentName>` (default: "
                    "the job's trainyard experiment, else `<tenant>/jobs`)")


class TrainingSpec(_Wire):
    """What a researcher submits. Immutable: a new configuration is a new job."""

    spec_version: Literal["v1"]
    model_config_ref: Annotated[
        str | ModelConfig,
        Field(alias="modelConfig", description="catalog reference name@version, or an inline model"),
    ]
    dataset: str = Field(
        pattern=DATASET_REF_PATTERN,
        description="dataset name@version (your tenant's, else the platform's) or tenant/name@version "
                    "(shared with you); an accepted job's spec names it qualified, as resolved",
    )
    code_revision: str = Field(min_length=1, max_length=128)
    resources: Resources
    parallelism: Parallelism = Parallelism()
    checkpoint_policy: CheckpointPolicy = CheckpointPolicy(every_steps=1000)
    training: Training
    name: str | None = Field(default=None, max_length=128)
    priority: int = Field(default=0, ge=-1000, le=1000)
    init_from: InitFrom | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came later: earlier specs keep their hash
        description="initialise the model from another job's READY checkpoint (weights only)",
    )
    code: Code | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came later: earlier specs keep their hash
        description="the user's training code, pinned by content; unset: the built-in trainer",
    )
    export: Export | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came later: earlier specs keep their hash
        description="export the final checkpoint when the job succeeds (format hf: a transformers directory)",
    )
    fault_tolerance: FaultTolerance | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came later: earlier specs keep their hash
        description="replicas that fail are replaced while the others keep training (no restart)",
    )
    evaluation: Evaluation | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came later: earlier specs keep their hash
        description="do not train: evaluate the checkpoint initFrom names (jobId and globalStep)",
    )
    tracking: Tracking | None = Field(
        default=None, exclude_if=lambda v: v is None,  # came later: earlier specs keep their hash
        description="opt in or out of the tenant's tracking targets (MLflow, TensorBoard); unset: every target "
                    "the tenant has",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainingSpec:
        if isinstance(self.model_config_ref, str):
            import re

            if not re.match(REF_PATTERN, self.model_config_ref):
                raise ValueError("modelConfig must be a catalog reference name@version or an object")
        world = self.parallelism.world_size
        if world != self.resources.gpu_count:
            raise ValueError(
                f"parallelism data*tensor*pipeline = {self.parallelism.data}*{self.parallelism.tensor}"
                f"*{self.parallelism.pipeline} = {world} must equal resources.gpuCount = {self.resources.gpu_count}"
            )
        t = self.training
        per_step = t.micro_batch_size * self.parallelism.data
        if t.global_batch_size % per_step:
            raise ValueError(
                f"training.globalBatchSize ({t.global_batch_size}) must be a multiple of "
                f"microBatchSize ({t.micro_batch_size}) x parallelism.data ({self.parallelism.data}) = {per_step}"
            )
        ft = self.fault_tolerance
        if ft is not None:
            p = self.parallelism
            if p.data != ft.replicas or p.tensor != 1 or p.pipeline != 1:
                raise ValueError(
                    f"faultTolerance.replicas ({ft.replicas}) must equal parallelism.data, with tensor and pipeline "
                    "1: each replica is one rank (replica groups of several ranks are not supported yet)")
            if t.sharding not in (None, "ddp"):
                raise ValueError("faultTolerance replicates the model on every replica: training.sharding must be "
                                 "ddp (or unset)")
        return self

    @property
    def grad_accumulation(self) -> int:
        return self.training.global_batch_size // (
            self.training.micro_batch_size * self.parallelism.data
        )

    def wire(self) -> dict[str, Any]:
        """The spec as JSON-ready camelCase data, defaults filled in."""
        return self.model_dump(mode="json", by_alias=True)

    def spec_hash(self) -> str:
        return spec_hash(self.wire())


def canonical_json(data: Any) -> bytes:
    """Deterministic JSON: sorted keys, no whitespace, UTF-8."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def spec_hash(wire: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(wire)).hexdigest()
