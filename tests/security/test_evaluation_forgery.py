"""Evaluation results are a rank's claim: an evaluation job's rank (user code, sandboxed, on the real local stack)
that forges EvaluationReported for another job or attempt fails its job as a security violation; one that reports
too many, badly named or non-finite numbers has its line refused; and no evaluation of tenant A attaches anything
to tenant B's checkpoint — the API refuses to evaluate another tenant's checkpoint, and the registry attaches a
result only to the checkpoint the evaluation job's own spec names. An honest evaluation attaches, once."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from trainyard_cli.stack import LocalStack

from tests.security.test_forged_events import PRELUDE, finished, submit, tenant_token
from tests.support.stack import running_stack

REPO = Path(__file__).resolve().parents[2]
VICTIM_TENANT = "victim"
# in every run of the suite, not a long one: an attack on what the registry attaches belongs in CI
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.security, pytest.mark.timeout(1500)]

REPORT = '''
def report(**changes):
    spool("trainyard.checkpoints", {"eventType": "EvaluationReported", "jobId": JOB, "tenant": TENANT,
                                    "attempt": ATTEMPT, "rank": 0, "metrics": {"loss": 1.5}, **changes})
'''
EVALUATIONS: dict[str, tuple[str, str | None]] = {  # name → (script body, the security reason; None: it succeeds)
    "forge-for-another-job": ('report(jobId=VICTIM, tenant=VICTIM_TENANT, metrics={"loss": 0.01})',
                              "names jobId"),
    "forge-for-another-attempt": ('report(attempt=ATTEMPT + 1, metrics={"loss": 0.02})', "names attempt"),
    "too-many-metrics": ('report(metrics={f"m{i}": 1.0 for i in range(1000)})', None),
    "non-finite": ('report(metrics={"loss": float("nan")})', None),
    "odd-names": ('report(metrics={"loss\\n# HELP evil": 1.0})', None),
    "honest": ('report(metrics={"loss": 1.5, "accuracy": 0.5})', None),
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from running_stack(tmp_path_factory, "evaluation-forgery")


def tiny(name: str) -> dict[str, Any]:
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["name"] = name
    spec["training"]["maxSteps"] = 10
    spec["checkpointPolicy"] = {"everySteps": 10, "keepLast": 10}
    return spec


def evaluation_spec(name: str, trained: str, victim: str) -> dict[str, Any]:
    return {
        "specVersion": "v1", "name": name, "modelConfig": "gpt-tiny@v1", "dataset": "tinycorpus@v1",
        "codeRevision": "attack", "evaluation": {}, "initFrom": {"jobId": trained, "globalStep": 10},
        "code": {"entrypoint": ["python", "attack.py"], "env": {"VICTIM_JOB": victim, "VICTIM_TENANT": VICTIM_TENANT}},
        "resources": {"gpuType": "cpu", "gpuCount": 1}, "parallelism": {"data": 1},
        "checkpointPolicy": {"everySteps": 1000},
        "training": {"seed": 0, "sequenceLength": 16, "microBatchSize": 1, "globalBatchSize": 1, "learningRate": 0.01,
                     "maxSteps": 10},
    }


def test_forged_and_unbounded_evaluations_attach_nothing(stack: LocalStack, tmp_path: Path) -> None:
    victim_token = tenant_token(stack, VICTIM_TENANT)
    attacker_token = stack.token_file.read_text().strip()
    url = stack.s.api_url
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {victim_token}"}, timeout=30) as victim_api, \
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {attacker_token}"}, timeout=30) as api:
        victim = victim_api.post("/v1/training-jobs", json=tiny("victim")).raise_for_status().json()["jobId"]
        trained = api.post("/v1/training-jobs", json=tiny("attacker")).raise_for_status().json()["jobId"]
        assert finished(victim_api, victim)["state"] == "succeeded"
        assert finished(api, trained)["state"] == "succeeded"

        # the API will not evaluate another tenant's checkpoint: it is no job of the attacker's
        resp = api.post("/v1/training-jobs", json={**tiny("steal"), "evaluation": {},
                                                   "initFrom": {"jobId": victim, "globalStep": 10}})
        assert resp.status_code == 422 and [d["field"] for d in resp.json()["detail"]] == ["initFrom.jobId"], resp.text

        jobs: dict[str, str] = {}
        for name, (body, _) in EVALUATIONS.items():
            code = tmp_path / name
            code.mkdir()
            (code / "attack.py").write_text(PRELUDE + REPORT + textwrap.dedent(body) + "\n")
            jobs[name] = submit(stack, attacker_token, evaluation_spec(name, trained, victim), code, tmp_path)
        for name, job_id in jobs.items():
            ended = finished(api, job_id)
            why = EVALUATIONS[name][1]
            if why is None:
                assert ended["state"] == "succeeded", (name, ended)
                continue
            reason = ended.get("reason") or ""
            assert ended["state"] == "failed" and reason.startswith("security: ") and why in reason, (name, reason)

        # only the honest evaluation is attached, to the attacker's own checkpoint; the victim's has none
        shown = api.get(f"/v1/training-jobs/{trained}/evaluations").raise_for_status().json()["evaluations"]
        assert [(e["evaluationJobId"], e["globalStep"], e["metrics"]) for e in shown] == [
            (jobs["honest"], 10, {"loss": 1.5, "accuracy": 0.5})], shown
        assert victim_api.get(f"/v1/training-jobs/{victim}/evaluations").json()["evaluations"] == []
        assert api.get(f"/v1/training-jobs/{victim}/evaluations").status_code == 404
