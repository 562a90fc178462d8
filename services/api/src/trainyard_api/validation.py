"""Spec validation that speaks the wire format: every problem names its camelCase dotted field.

Pure functions, no I/O. Two stages (and :func:`strict_body_errors`, which holds a JSON body to the
types its schema gives):

1. :func:`field_errors` turns pydantic's errors (from ``TrainingSpec`` validation, or
   FastAPI's ``RequestValidationError``) into ``FieldProblem(field, message)``: union
   branch tags are removed, the branch the client obviously meant is kept, and a
   model-level validator's message is pinned to the field it talks about.
2. :func:`check_references` resolves what needs the catalog and the dataset registry
   (the caller looks the dataset up and passes the answer in).
"""

from __future__ import annotations

import json
import math
import re
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, NoReturn

from pydantic import BaseModel, TypeAdapter, ValidationError

from trainyard_contract.catalog import ModelConfig
from trainyard_contract.errors import ConfigError, SpecError
from trainyard_contract.hfdir import HfDir, inline_config, shape_differences
from trainyard_contract.spec import REF_PATTERN, TrainingSpec

# FastAPI prefixes a location with where the value came from; only the body is the spec.
_SOURCES = ("body", "query", "path", "header", "cookie")
_TYPE_ERROR = re.compile(r"^(\w+_type|\w+_parsing|is_instance_of|union_tag_invalid)$")
_ROOT = "spec"
TEMPLATE_ROOT = "template"
"""The field of a trigger's body that holds a spec (its problems are named ``template.<field>``)."""
EXPERIMENT_BASE = "base"
"""The field of an experiment's body that holds a spec (its problems are named ``base.<field>``)."""


@dataclass(frozen=True)
class FieldProblem:
    """One thing wrong with a request: ``field`` is a camelCase dotted path (``training.maxSteps``)."""

    field: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message}


class InvalidSpecError(SpecError):
    """A spec with one or more problems; the API answers 422 listing all of them."""

    def __init__(self, problems: Sequence[FieldProblem]) -> None:
        first = problems[0] if problems else FieldProblem(_ROOT, "invalid spec")
        super().__init__(first.field, first.message)
        self.problems = list(problems) or [first]


# ----------------------------------------------------------------------------- field paths


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through unions, Optional, lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(_models_in(arg))
    return found


@cache
def spec_field_paths(model: type[BaseModel] = TrainingSpec) -> tuple[str, ...]:
    """Every camelCase dotted field path of ``model``, parents before children."""
    paths: list[str] = []
    for name, info in model.model_fields.items():
        alias = info.alias or name
        paths.append(alias)
        for sub in _models_in(info.annotation):
            paths.extend(f"{alias}.{child}" for child in spec_field_paths(sub))
    return tuple(paths)


def _is_branch_tag(part: Any) -> bool:
    """pydantic names a union member in the location: ``str``, ``constrained-str``, ``ModelConfig``,
    ``function-after[…]`` (field names are camelCase: never capitalised, never with ``-`` or ``[``)."""
    if not isinstance(part, str):
        return False
    return ("[" in part or part[:1].isupper() or part.startswith("constrained-")
            or part in {"str", "int", "float", "bool", "none", "dict", "list"})


def _format_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _locate_in_message(prefix: str, message: str) -> str:
    """For a model-level error at ``prefix``: the field the message names first, else ``prefix``."""
    start = f"{prefix}." if prefix else ""
    candidates = [p[len(start):] for p in spec_field_paths() if p.startswith(start)]
    best: tuple[int, int, str] | None = None
    for rel in candidates:
        # the field by its own name, or by its whole path (``code.repo needs code.revision``)
        match = re.search(rf"(?<![\w.])(?:{re.escape(start)})?{re.escape(rel)}(?![\w])", message)
        if match and (best is None or (match.start(), -len(rel)) < (best[0], best[1])):
            best = (match.start(), -len(rel), rel)
    if best is None:
        return prefix or _ROOT
    return f"{start}{best[2]}"


def decimal_at_most(limit: int) -> str:
    """A regular expression (unanchored, one group) for the decimal numbers 0..``limit``, with leading zeros
    up to ``limit``'s number of digits: a bound JSON Schema can state on a string (``pattern``), where
    ``maximum`` applies only to numbers. Each branch is one prefix of ``limit``'s digits, a smaller digit,
    then any digits."""
    digits = str(limit)
    branches = [f"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    for i, digit in enumerate(digits):
        rest = len(digits) - i - 1
        if digit != "0":
            smaller = "0" if digit == "1" else f"[0-{int(digit) - 1}]"
            branches.append(digits[:i] + smaller + (f"[0-9]{{{rest}}}" if rest else ""))
    return "(?:" + "|".join([*branches, digits]) + ")"


U64_MAX = 2**64 - 1
STREAM_ID_PATTERN = rf"^{decimal_at_most(U64_MAX)}-{decimal_at_most(U64_MAX)}$"
"""A Redis stream id, ``<milliseconds>-<sequence>``: two unsigned 64-bit numbers."""

_PATTERN_MESSAGES = {
    REF_PATTERN: "must be a reference name@version (letters, digits, '.', '_' and '-'; e.g. tinycorpus@v1)",
    STREAM_ID_PATTERN: f"must be a stream id <milliseconds>-<sequence>, each a number from 0 to {U64_MAX} "
                       "(the nextBefore of the previous page)",
}
"""What a pattern means, said instead of the pattern."""


def _clean_message(error: Mapping[str, Any]) -> str:
    kind = error.get("type", "")
    msg = str(error.get("msg", "invalid value"))
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field: it is not part of the spec (check the spelling; fields are camelCase)"
    if kind == "json_invalid":
        return f"the body is not valid JSON: {error.get('ctx', {}).get('error', msg)}"
    if kind == "string_pattern_mismatch" and error.get("ctx", {}).get("pattern") in _PATTERN_MESSAGES:
        return _PATTERN_MESSAGES[error["ctx"]["pattern"]]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def _split_location(loc: Sequence[Any]) -> tuple[list[Any], str | None, list[Any]]:
    """(path before the first union tag, the tag, the path after it)."""
    for i, part in enumerate(loc):
        if _is_branch_tag(part):
            return list(loc[:i]), str(part), list(loc[i + 1:])
    return list(loc), None, []


def _drop_mismatched_branches(errors: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """In a union, keep the branches whose type matched; if none did, keep one error per union."""
    by_union: dict[tuple[Any, ...], dict[str, list[Mapping[str, Any]]]] = {}
    for error in errors:
        head, tag, _ = _split_location(tuple(error.get("loc", ())))
        if tag is not None:
            by_union.setdefault(tuple(head), {}).setdefault(tag, []).append(error)
    kept: list[Mapping[str, Any]] = []
    emitted: set[tuple[Any, ...]] = set()
    for error in errors:
        head, tag, rest = _split_location(tuple(error.get("loc", ())))
        if tag is None:
            kept.append(error)
            continue
        branches = by_union[tuple(head)]
        matched = {t for t, errs in branches.items()
                   if not all(_TYPE_ERROR.match(e.get("type", "")) and not _split_location(e["loc"])[2]
                              for e in errs)}
        if matched:  # of the branches that took the value's type, the one it is closest to
            fewest = min(len(branches[t]) for t in matched)
            matched = {t for t in matched if len(branches[t]) == fewest}
        if matched:
            if tag in matched:
                kept.append({**error, "loc": (*head, *rest)})
        elif tuple(head) not in emitted:
            emitted.add(tuple(head))
            names = ", ".join(_branch_name(t) for t in branches)
            kept.append({"type": "union_type", "loc": tuple(head),
                         "msg": f"has the wrong type: expected one of {names}"})
    return kept


def _branch_name(tag: str) -> str:
    if "[" in tag:  # function-after[validator(), ModelConfig]
        return tag.rsplit(",", 1)[-1].strip(" ]") + " object"
    tag = tag.removeprefix("constrained-")
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(tag, tag)


def field_errors(errors: Sequence[Mapping[str, Any]]) -> list[FieldProblem]:
    """pydantic / FastAPI validation errors → one ``FieldProblem`` per distinct problem.

    Locations become camelCase dotted paths relative to the spec (``training.globalBatchSize``);
    query or path parameters keep their source (``query.limit``).
    """
    problems: list[FieldProblem] = []
    for error in _drop_mismatched_branches(list(errors)):
        loc = list(error.get("loc", ()))
        source = loc.pop(0) if loc and loc[0] in _SOURCES else "body"
        if source != "body":
            problems.append(FieldProblem(_format_path([source, *loc]), _clean_message(error)))
            continue
        if error.get("type") == "json_invalid":
            problems.append(FieldProblem("body", _clean_message(error)))
            continue
        # a spec inside the body (a trigger's ``template``, an experiment's ``base``): its fields are located as
        # a spec's, under it
        nested = [str(loc[0])] if loc[:1] in ([TEMPLATE_ROOT], [EXPERIMENT_BASE]) else []
        field = _format_path(loc[len(nested):])
        if error.get("type") in ("value_error", "assertion_error"):
            field = _locate_in_message(field, _clean_message(error))
        if nested:
            field = nested[0] if field in ("", _ROOT) else f"{nested[0]}.{field}"
        problem = FieldProblem(field or _ROOT, _clean_message(error))
        if problem not in problems:
            problems.append(problem)
    return problems


def with_json_positions(errors: Sequence[Mapping[str, Any]], document: object) -> list[Mapping[str, Any]]:
    """``errors`` with each undecodable-JSON error's message made whole: FastAPI passes on the decoder's
    bare message (``Invalid control character at``) and puts the position in the location; the message
    then says where, as :class:`json.JSONDecodeError` does (``…: line 1 column 11 (char 10)``)."""
    out: list[Mapping[str, Any]] = []
    for error in errors:
        loc, ctx = tuple(error.get("loc", ())), error.get("ctx") or {}
        if (error.get("type") == "json_invalid" and isinstance(document, str) and len(loc) == 2
                and isinstance(loc[1], int) and isinstance(ctx.get("error"), str)):
            whole = str(json.JSONDecodeError(ctx["error"], document, min(max(loc[1], 0), len(document))))
            error = {**error, "loc": ("body",), "ctx": {**ctx, "error": whole}}
        out.append(error)
    return out


# ----------------------------------------------------------------------------- strict bodies


class _NotJsonNumber(ValueError):
    pass


def _json_number(text: str) -> int | float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJsonNumber(f"{text} is out of the range of a number")
    return int(value) if value.is_integer() else value  # JSON Schema: 5.0 is the integer 5


def _not_json(constant: str) -> NoReturn:
    raise _NotJsonNumber(f"{constant} is not a JSON number")


def strict_body_errors(adapter: TypeAdapter[Any], raw: bytes) -> list[dict[str, Any]]:
    """pydantic's errors (located under ``body``) for the JSON ``raw`` against ``adapter``'s type in strict
    mode: ``0`` is not ``false``, ``"5"`` is not ``5``; ``5.0`` is the integer 5, as in JSON Schema;
    ``NaN`` and ``Infinity`` are not JSON numbers. Empty when it conforms, and when it is no JSON at all
    (the lax validation reports that)."""
    try:
        body = json.loads(raw, parse_float=_json_number, parse_constant=_not_json)
    except _NotJsonNumber as exc:
        return [{"type": "json_invalid", "loc": ("body",), "msg": str(exc), "ctx": {"error": str(exc)}}]
    except ValueError:
        return []
    try:
        adapter.validate_json(json.dumps(body), strict=True)
    except ValidationError as exc:
        return [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    return []


# ----------------------------------------------------------------------------- references


def under(root: str, problems: Sequence[FieldProblem]) -> list[FieldProblem]:
    """``problems`` of a spec nested at ``root`` of a body (``modelConfig`` → ``template.modelConfig``)."""
    return [FieldProblem(root if p.field in ("", _ROOT) else f"{root}.{p.field}", p.message) for p in problems]


def resolve_model_config(spec: TrainingSpec, catalog: Mapping[str, ModelConfig]) -> ModelConfig | None:
    """The spec's model: inline, or looked up in ``catalog`` (None when the reference is unknown)."""
    ref = spec.model_config_ref
    return ref if isinstance(ref, ModelConfig) else catalog.get(ref)


def check_init_from(spec: TrainingSpec, *, parent_known: bool, ready_steps: Sequence[int]) -> list[FieldProblem]:
    """``initFrom`` must name a job of the caller's tenant with a READY checkpoint (at ``globalStep``
    when given). ``parent_known``: the job exists for this tenant; ``ready_steps``: its READY steps."""
    init = spec.init_from
    if init is None or init.job_id is None:
        return []
    if not parent_known:
        return [FieldProblem("initFrom.jobId", f"unknown job {init.job_id!r}: initFrom names an earlier job "
                                               "of your tenant (GET /v1/training-jobs lists them)")]
    if not ready_steps:
        return [FieldProblem("initFrom.jobId", f"job {init.job_id!r} has no READY checkpoint to start from yet")]
    if init.global_step is not None and init.global_step not in ready_steps:
        steps = ", ".join(str(s) for s in sorted(ready_steps)[-10:])
        return [FieldProblem("initFrom.globalStep", f"job {init.job_id!r} has no READY checkpoint at step "
                                                    f"{init.global_step}; READY steps: {steps}")]
    return []


def check_evaluation(spec: TrainingSpec) -> list[FieldProblem]:
    """``evaluation`` evaluates one READY checkpoint (``initFrom.jobId`` and ``initFrom.globalStep``) and trains
    nothing: no Hugging Face start, no export of a final model, no replicas to replace."""
    if spec.evaluation is None:
        return []
    init, problems = spec.init_from, []
    if init is None or init.job_id is None:
        problems.append(FieldProblem("initFrom.jobId", "evaluation evaluates a checkpoint: initFrom names the job "
                                                       "(jobId) and the step (globalStep) of a READY checkpoint"))
    elif init.global_step is None:
        problems.append(FieldProblem("initFrom.globalStep", "evaluation evaluates one checkpoint: name its step "
                                                            "(initFrom.globalStep)"))
    if spec.export is not None:
        problems.append(FieldProblem("export", "an evaluation trains nothing, so it has no final model to export"))
    if spec.fault_tolerance is not None:
        problems.append(FieldProblem("faultTolerance", "an evaluation has no training steps to keep replicas for"))
    return problems


def tensor_parallel_problems(model: ModelConfig, tensor: int, label: str) -> list[FieldProblem]:
    """The trainer's rule for ``parallelism.tensor``: each rank computes whole query heads, whole
    key/value heads (llama's grouped-query attention has fewer) and an equal share of the FFN."""
    widths = [("nHeads", model.n_heads)]
    if model.kv_heads != model.n_heads:
        widths.append(("nKvHeads", model.kv_heads))
    widths.append(("the FFN width (dFf)" if model.d_ff is not None else "the FFN width (4 x dModel)",
                   model.ffn_width))
    failing = [(name, value) for name, value in widths if value % tensor]
    if not failing:
        return []
    named = " and ".join(f"{name} ({value})" for name, value in failing)
    return [FieldProblem("parallelism.tensor", f"tensor parallelism ({tensor}) must divide {named} of {label}: each "
                                               "rank computes whole heads; choose a parallelism.tensor that divides "
                                               "all of " + ", ".join(str(v) for _, v in widths))]


HF_FIELD = "initFrom.huggingFace"


def check_hugging_face_start(spec: TrainingSpec, model: ModelConfig | None,
                             found: HfDir | ConfigError) -> list[FieldProblem]:
    """``initFrom.huggingFace`` must be a usable directory (``found``: what
    :func:`~trainyard_contract.hfdir.inspect_dir` found there, or why it refused) whose model has the
    shape of the spec's ``model`` (None: the spec's model is unknown, which is reported on its own)."""
    if spec.init_from is None or spec.init_from.hugging_face is None:
        return []
    name = spec.init_from.hugging_face
    if isinstance(found, ConfigError):
        return [FieldProblem(HF_FIELD, f"cannot start from {name!r}: {found.message}")]
    if model is None:
        return []
    differences = shape_differences(model, found.config)
    if not differences:
        return []
    label = spec.model_config_ref if isinstance(spec.model_config_ref, str) else "the inline modelConfig"
    return [FieldProblem(HF_FIELD, (
        f"the model in {name!r} is not the shape of {label}: {'; '.join(differences)}. Train the directory's "
        f"model: set modelConfig to {inline_config(found.config)}"))]


def check_references(
    spec: TrainingSpec, *, catalog: Mapping[str, ModelConfig], dataset_known: bool,
    dataset_vocab: int | None = None,
) -> list[FieldProblem]:
    """What a structurally valid spec can still get wrong: unknown model or dataset, a model
    that cannot take the requested sequence length or tensor-parallel degree, or whose vocabulary
    is smaller than the dataset's tokenizer's (``dataset_vocab``, when the registry knows it)."""
    problems: list[FieldProblem] = []
    model = resolve_model_config(spec, catalog)
    if model is None:
        known = ", ".join(sorted(catalog)) or "(empty)"
        problems.append(FieldProblem(
            "modelConfig",
            f"unknown model {spec.model_config_ref!r}: the model catalog has {known}; "
            "or give the model inline as an object",
        ))
    else:
        label = spec.model_config_ref if isinstance(spec.model_config_ref, str) else "the inline model"
        if spec.training.sequence_length > model.max_seq_len:
            problems.append(FieldProblem(
                "training.sequenceLength",
                f"sequenceLength ({spec.training.sequence_length}) exceeds maxSeqLen "
                f"({model.max_seq_len}) of {label}",
            ))
        if dataset_vocab is not None and model.vocab_size < dataset_vocab:
            problems.append(FieldProblem(
                "modelConfig.vocabSize" if not isinstance(spec.model_config_ref, str) else "modelConfig",
                f"{label} has a vocabulary of {model.vocab_size}, but dataset {spec.dataset!r} was tokenized "
                f"with {dataset_vocab} tokens: its ids would not fit the embedding. Use a model with vocabSize "
                f">= {dataset_vocab} (inline: modelConfig.vocabSize), or a dataset tokenized for this model",
            ))
        problems.extend(tensor_parallel_problems(model, spec.parallelism.tensor, label))
    if not dataset_known:
        problems.append(FieldProblem(
            "dataset",
            f"unknown dataset {spec.dataset!r}: no verified version of that name your tenant may use "
            "(its own, the platform's, or one shared with it). Publish it first (POST /v1/datasets or "
            "`trainyard datasets import --publish`; `make data` or `trainyard dev data` publishes the example "
            "tinycorpus@v1); GET /v1/datasets lists what you may use",
        ))
    return problems

