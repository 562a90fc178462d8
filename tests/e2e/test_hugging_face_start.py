"""Start training from a Hugging Face directory trainyard did not write: transformers saves a LlamaForCausalLM,
``trainyard models import`` brings it into the tenant's prefix, a 2-rank FSDP job with ``initFrom.huggingFace``
runs on the real stack (sandboxed ranks that see the directory read-only), and the weights the trainer
loaded are the transformers model's: its one step at a learning rate of 1e-9 changes no weight by more than
1e-6, so its checkpoint's logits equal the transformers model's within 1e-5 (a random initialisation is
far off). And each directory that cannot start the job is a 422 on ``initFrom.huggingFace`` saying what to do."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from trainyard_cli.stack import LocalStack
from trainyard_contract.catalog import MODEL_CATALOG
from trainyard_contract.storage import ArtifactLayout, sha256_file, uri_to_path

from tests.support.cli import trainyard
from tests.support.hfmodels import hf_logits, save_transformers_model
from tests.support.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LLAMA = MODEL_CATALOG["llama-tiny@v1"]
SPEC: dict[str, Any] = {
    "specVersion": "v1", "name": "from-hugging-face", "modelConfig": "llama-tiny@v1", "dataset": "tinycorpus@v1",
    "codeRevision": "local", "resources": {"gpuType": "cpu", "gpuCount": 2, "topology": "4-device-nodes"},
    "parallelism": {"data": 2, "tensor": 1, "pipeline": 1},
    "checkpointPolicy": {"everySteps": 1, "keepLast": 1},
    "training": {"seed": 3, "sequenceLength": 32, "microBatchSize": 2, "globalBatchSize": 4,
                 "learningRate": 1e-9, "lrSchedule": {"name": "constant"}, "maxSteps": 1, "sharding": "fsdp"},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from running_stack(tmp_path_factory, "hfstart")


def client_for(stack: LocalStack) -> httpx.Client:
    token = stack.token_file.read_text().strip()
    return httpx.Client(base_url=stack.s.api_url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def spec(directory: str, **changes: Any) -> dict[str, Any]:
    s = copy.deepcopy(SPEC)
    s["initFrom"] = {"huggingFace": directory}
    return s | changes


def refusal(client: httpx.Client, body: dict[str, Any]) -> str:
    resp = client.post("/v1/training-jobs", json=body)
    assert resp.status_code == 422, resp.text
    problems = resp.json()["detail"]
    assert [p["field"] for p in problems] == ["initFrom.huggingFace"], problems
    return problems[0]["message"]


def wait_for_end(client: httpx.Client, job_id: str, timeout_s: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/training-jobs/{job_id}").raise_for_status().json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} still {job.get('state')}: {json.dumps(job)[:2000]}")


def test_a_job_starts_from_an_imported_transformers_directory(stack: LocalStack, tmp_path: Path) -> None:
    source = tmp_path / "from-transformers"
    reference = save_transformers_model(source, LLAMA, seed=7)
    root = stack.s.artifact_root
    imported = trainyard(stack, "models", "import", str(source), "--name", "tiny-hf",
                         "--artifact-root", str(root), "--json")
    assert imported.returncode == 0, imported.stderr
    summary = json.loads(imported.stdout)
    tenant, directory = summary["tenant"], Path(summary["directory"])  # the token's tenant, asked of the API
    assert directory == ArtifactLayout(root).model_dir(tenant, "tiny-hf")

    with client_for(stack) as client:
        resp = client.post("/v1/training-jobs", json=spec("models/tiny-hf"))
        assert resp.status_code == 202, resp.text
        job_id = resp.json()["jobId"]
        job = wait_for_end(client, job_id)
        assert job["state"] == "succeeded", json.dumps(job)[:3000]
        start = job["huggingFaceStart"]
        assert start["directory"] == "models/tiny-hf" and start["uri"] == directory.as_uri()
        assert start["configSha256"] == sha256_file(directory / "config.json")
        assert start["weightFiles"] == {"model.safetensors": (directory / "model.safetensors").stat().st_size}
        ckpts = client.get(f"/v1/training-jobs/{job_id}/checkpoints").raise_for_status().json()
        ckpts = ckpts.get("checkpoints", ckpts) if isinstance(ckpts, dict) else ckpts
        final = next(c for c in ckpts if c["state"] == "READY" and c["globalStep"] == 1)

    layout = ArtifactLayout(root)
    record = json.loads((layout.attempt_dir(tenant, job_id, 1) / "run-record.json").read_text())
    assert record["restore"]["huggingFaceUri"] == directory.as_uri(), record["restore"]
    assert "initialised from the Hugging Face directory models/tiny-hf" in record["restore"]["reason"]
    assert record["parallelism"]["sharding"] == "fsdp"

    # the checkpoint the trainer wrote after one step at lr 1e-9 holds the transformers weights
    from trainyard_trainer.hf import checkpoint_model_state, from_hf_state_dict
    from trainyard_trainer.model import build_model

    _, saved = checkpoint_model_state(final["manifestUri"])
    theirs = from_hf_state_dict(LLAMA, reference.state_dict())
    assert set(saved) == set(theirs)
    worst = max((saved[n] - theirs[n]).abs().max().item() for n in theirs)
    assert worst <= 1e-6, worst
    ours = build_model(LLAMA, seed=0, device=torch.device("cpu")).eval()
    idx = torch.randint(0, LLAMA.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        random_logits = ours(idx)[0]
        ours.load_state_dict(saved)
        logits = ours(idx)[0]
    expected = hf_logits(reference, idx)
    assert (random_logits - expected).abs().max() > 1e-2  # the comparison below can fail
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    assert uri_to_path(final["manifestUri"]).exists()


def test_directories_that_cannot_start_a_job_are_refused_on_the_field(stack: LocalStack, tmp_path: Path) -> None:
    layout = ArtifactLayout(stack.s.artifact_root)
    with client_for(stack) as client:
        tenant = client.get("/v1/datasets").raise_for_status().json()["tenant"]
        mine = layout.tenant_dir(tenant) / "models"
        save_transformers_model(mine / "llama", LLAMA, seed=1)
        save_transformers_model(layout.model_dir("someone-else", "theirs"), LLAMA, seed=2)
        (mine / "borrowed").symlink_to(layout.model_dir("someone-else", "theirs"))
        save_transformers_model(mine / "no-config", LLAMA, seed=3)
        (mine / "no-config" / "config.json").unlink()
        save_transformers_model(mine / "mistral", LLAMA, seed=4)
        config = json.loads((mine / "mistral" / "config.json").read_text())
        (mine / "mistral" / "config.json").write_text(json.dumps(config | {"model_type": "mistral"}))

        for bad in ("models/../../someone-else/models/theirs", "/etc"):
            resp = client.post("/v1/training-jobs", json=spec(bad))
            assert resp.status_code == 422 and "initFrom" in resp.text, resp.text
        assert "is not a directory" in refusal(client, spec("models/theirs"))  # another tenant's name: not ours
        assert "outside your tenant's prefix" in refusal(client, spec("models/borrowed"))
        assert "has no config.json" in refusal(client, spec("models/no-config"))
        assert "model_type = 'mistral'" in refusal(client, spec("models/mistral"))
        message = refusal(client, spec("models/llama", modelConfig="gpt-tiny@v1"))
        assert "architecture: gpt2 in the spec, llama in the directory" in message
        inline = json.loads(message.split("set modelConfig to ", 1)[1])
        accepted = client.post("/v1/training-jobs", json=spec("models/llama", modelConfig=inline,
                                                              training={**SPEC["training"], "maxSteps": 1}))
        assert accepted.status_code == 202, accepted.text  # the message's modelConfig is the one that works
        client.post(f"/v1/training-jobs/{accepted.json()['jobId']}/cancel")
