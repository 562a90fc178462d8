"""A schemathesis check of this API's own: schema-valid input may be refused (422) only for the rules
that live beyond what a JSON Schema can say, each named here with the field it is reported on.

``POST /v1/training-jobs`` and ``POST /v1/plan`` check references (the model catalog, the dataset
registry, an earlier job's checkpoints), relations between fields (dp x tp x pp = devices, a batch
the micro-batches divide) and what the planner computes (a model that cannot fit its device). Their
422 to a request the document calls valid must name only such a rule; a 422 for anything else
means the document lacks a constraint the server enforces. Loaded by test_openapi.py, and by the
CLI through ``hooks`` in schemathesis.toml.
"""

from __future__ import annotations

import re

import schemathesis
from schemathesis import CheckContext, Case, Response

# code archives are bytes: send them as the document's application/gzip, the way octet-stream is sent
schemathesis.serializer.alias("application/gzip", "application/octet-stream")

# (field, message) patterns per operation: the rules the document cannot state.
RULES_BEYOND_THE_SCHEMA: dict[str, list[tuple[str, str]]] = {
    "POST /v1/training-jobs": [
        ("modelConfig", r"^unknown model |does not fit one "),  # the catalog; the planner's memory estimate
        ("modelConfig.dModel", r"must be divisible by nHeads|must be even for architecture 'llama'"),
        ("modelConfig.nHeads", r"must be divisible by nKvHeads"),  # grouped-query attention
        ("modelConfig.nKvHeads", r"applies only to architecture 'llama'"),
        ("dataset", r"^unknown dataset "),  # the dataset registry
        ("parallelism", r"must equal resources\.gpuCount"),
        ("parallelism.tensor", r"must divide (nHeads|nKvHeads|the FFN width)"),  # whole heads per TP rank
        ("resources.gpuType", r"GB per device and this job needs"),
        ("training.globalBatchSize", r"must be a multiple of microBatchSize"),
        ("training.sequenceLength", r"exceeds maxSeqLen"),
        # faultTolerance: replicas of one rank each, no more than there are, the model whole on each
        ("faultTolerance.minReplicas", r"must not exceed faultTolerance\.replicas"),
        (r"faultTolerance(\.replicas)?|training\.sharding|parallelism",
         r"must equal parallelism\.data|training\.sharding must be\s+ddp"),
        (r"checkpointPolicy\.\w+", r"set exactly one of everySteps or everyMinutes|with auto, set at most one"),
        ("initFrom.jobId", r"^unknown job |has no READY checkpoint|names exactly one of jobId"),  # a tenant's job
        ("initFrom.globalStep", r"has no READY checkpoint at step|goes with jobId, not huggingFace"),
        # evaluation: one READY checkpoint (initFrom.jobId and globalStep), nothing trained
        ("initFrom.jobId", r"^evaluation evaluates a checkpoint"),
        ("initFrom.globalStep", r"^evaluation evaluates one checkpoint"),
        ("export", r"^an evaluation trains nothing"),
        ("faultTolerance", r"^an evaluation has no training steps"),
        # a directory under the tenant's prefix of the artifact store, of the spec's model's shape
        ("initFrom.huggingFace", r"^cannot start from |is not the shape of |must stay inside your tenant's prefix"),
        # code: one of archive / repo + revision; what git and the tenant's uploads say
        ("code.archive", r"^code needs archive |^no code archive \S+ was uploaded for this tenant|archives to"),
        ("code.repo", r"needs code\.revision|neither a URL nor an absolute path|^no directory |not a git repository|"
                      r"cannot reach |cannot archive |must not start with|git took longer|cannot run git"),
        ("code.revision", r"needs code\.repo|has no (branch or tag|commit, branch or tag)|cannot fetch commit|"
                          r"must not start with"),
        ("code.commit", r"leave code\.commit out"),
        ("code.workingDir", r"must be a relative path inside the code tree"),
        ("code.env", r"must not set"),
        # the lock is read from the stored archive: a file of the tree, a lock the platform installs
        ("code.environment.lock", r"must be a relative path inside the code tree|is not a file of the code tree|"
                                  r"is a link in the code tree|not a regular file|a lock may be at most|"
                                  r"not allowed|not an exact pin|has no --hash|not a sha256 hash|is the node's own|"
                                  r"not valid TOML|not UTF-8|source is not allowed|no sha256 hash|"
                                  r"cannot find the project|is not a package name|is not a version|marker"),
        ("code.environment.sha256", r"leave code\.environment\.sha256 out"),
    ],
    # the body must be the archive the path names, and one the platform unpacks
    "PUT /v1/code/{archive}": [
        ("path.archive", r"^the body's sha256 is sha256:[0-9a-f]{64}, not "),
        ("body", r"not a readable code archive|not a path inside the code tree|outside the code tree|"
                 r"not a regular file|holds \S+ twice|expands past"),
    ],
    # an expiry is in the future, and given one way
    "POST /v1/admin/tenants/{tenant}/tokens": [
        ("expiresAt", r"is in the past|needs a UTC offset"),
        ("ttlSeconds", r"give expiresAt or ttlSeconds, not both"),
    ],
    # a tenant's MLflow URI: http(s), a host, no credentials, no metadata service (trainyard_contract.tracking)
    "PUT /v1/admin/tenants/{tenant}/tracking": [
        ("mlflowUri", r"at most \d+ characters|no whitespace|not a URL|scheme must be|name a host|no credentials|"
                      r"no query or fragment|port 0|metadata|link-local|not a unicast"),
    ],
    "POST /v1/plan": [
        ("model", r"^unknown model "),
        (r"model(\.dModel)?", r"must be divisible by nHeads|must be even for architecture 'llama'"),
        (r"model(\.nHeads)?", r"must be divisible by nKvHeads"),
        (r"model(\.nKvHeads)?", r"applies only to architecture 'llama'"),
        ("sequenceLength", r"exceeds maxSeqLen"),
        ("device", r"unknown device"),
        ("layout", r"must equal devices|interleaved schedule needs micro-batches|layersPerStage (names|holds)|"
                   r"cannot fill \d+ chunks|exceeds \d+ layers"),
        ("globalBatch", r"required to recommend|differs from the layout's"),
        ("checkpoint", r"out of the range of the planner's arithmetic"),  # e.g. exp(restart / MTBF)
    ],
}


# the series a job has are those its script reported (beyond the built-in ones): an id's own data
RULES_BEYOND_THE_SCHEMA["GET /v1/training-jobs/{job_id}/metrics"] = [
    ("query.series", r"^unknown series .+; this job has |^name at least one series"),
]


# the Lab names its model and device as POST /v1/plan does; the ends of its memory curve must ascend, and a
# tensor-parallel degree must split a node and the model's heads
_LAB_MODEL = [rule for rule in RULES_BEYOND_THE_SCHEMA["POST /v1/plan"] if rule[0] in (
    "model", r"model(\.dModel)?", r"model(\.nHeads)?", r"model(\.nKvHeads)?", "sequenceLength", "device")]
RULES_BEYOND_THE_SCHEMA["POST /v1/lab/memory"] = [*_LAB_MODEL, ("curveTo", r"must be above curveFrom")]
RULES_BEYOND_THE_SCHEMA["POST /v1/lab/scaling"] = [*_LAB_MODEL, ("tensor", r"^tensor \(\d+\) must divide ")]


# a trigger's template is checked as a submission is (its dataset aside), its problems named under template
RULES_BEYOND_THE_SCHEMA["POST /v1/triggers"] = [
    (rf"template\.(?:{field})", message) for field, message in RULES_BEYOND_THE_SCHEMA["POST /v1/training-jobs"]
    if field != "dataset"]
# what `on` asks of the other fields (docs/triggers.md): a glob, or one watched job or experiment and an evaluation
RULES_BEYOND_THE_SCHEMA["POST /v1/triggers"] += [
    ("job|experiment|everySteps", r"goes with on: checkpointReady$"),
    ("dataset", r"names the datasets it watches|watches a job or an experiment, not datasets"),
    ("job", r"watches exactly one of job or experiment"),
    ("template.evaluation", r"template is an evaluation"),
    ("template.initFrom", r"template names no initFrom"),
]

# an experiment (docs/experiments.md): its base is a spec, a trial's point is checked as a spec where the space sets it
RULES_BEYOND_THE_SCHEMA["POST /v1/experiments"] = [
    (rf"base\.(?:{field})", message) for field, message in RULES_BEYOND_THE_SCHEMA["POST /v1/training-jobs"]]
RULES_BEYOND_THE_SCHEMA["POST /v1/experiments"] += [
    ("base.dataset", r"^unknown dataset "),
    (r"base\.initFrom(\.\w+)?", r"names exactly one of jobId|must stay inside your tenant's prefix|goes with jobId"),
    # the point the sampler drew, written into the spec (any of the spec's own rules), and the space's keys, whose
    # pattern the document states as propertyNames, which schemathesis does not draw from
    (r"(?s)space\..+", r"(?s).+"),
    ("space", r"may not vary|parameter (has|is|needs)|must be below high|log-scale range needs|whole-number bounds"),
    ("search", r"^grid search walks listed values"),
    ("budget", r"exceeds the grid's \d+ points"),
    ("budget.maxTrials", r"^early stopping compares trials"),
    ("earlyStopping.minSteps", r"must come before base\.training\.maxSteps"),
]


def unexplained_problems(operation: str, detail: object) -> list[dict[str, str]]:
    """The problems of a 422 body that no rule of ``operation`` explains (all of them when it has none)."""
    rules = RULES_BEYOND_THE_SCHEMA.get(operation, [])
    problems = detail if isinstance(detail, list) else [{"field": "", "message": str(detail)}]
    return [p for p in problems
            if not any(re.fullmatch(field, str(p.get("field"))) and re.search(message, str(p.get("message")))
                       for field, message in rules)]


@schemathesis.check
def rejects_valid_input_only_for_rules_beyond_the_schema(
    ctx: CheckContext, response: Response, case: Case
) -> bool | None:
    """A 422 to positive (schema-valid) input names only rules the document cannot state."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code != 422:
        return None
    if case.operation.label not in RULES_BEYOND_THE_SCHEMA:
        return None  # positive_data_acceptance reports it
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = response.text
    if unexplained := unexplained_problems(case.operation.label, detail):
        raise AssertionError(
            "schema-valid input refused for a rule the document does not state (give the field the "
            f"constraint, or name the rule in tests/contract/checks.py if no schema can): {unexplained}")
    return None
