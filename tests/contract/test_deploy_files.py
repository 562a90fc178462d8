"""The deploy files are checked offline: every Kubernetes manifest in deploy/k8s against the schemas of a named
Kubernetes version (kubernetes-validate, whose schemas ship in the wheel), the compose file against the Compose
Specification's JSON Schema (vendored: deploy/compose/schema/README.md)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # requirements-dev.txt
import pytest
import yaml


REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
COMPOSE = REPO / "deploy" / "compose" / "docker-compose.yaml"
COMPOSE_SCHEMA = REPO / "deploy" / "compose" / "schema" / "compose-spec.json"
COMPOSE_SCHEMA_SHA256 = "56bab44c85c0ce8affb74474950293f37d510673283a243bcd7eeadb900fa35c"
KUBERNETES_VERSION = "1.30.0"
"""The oldest Kubernetes the manifests promise to work on (deploy/k8s/README.md)."""
CRDS = {("kafka.strimzi.io/v1beta2", "KafkaUser")}
"""Kinds of operators' CRDs, whose schemas are not Kubernetes': only their shape is checked here."""


def manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


MANIFESTS = manifests()


def test_there_are_manifests_of_every_file() -> None:
    files = {name.split(":")[0] for name, _ in MANIFESTS}
    assert files == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert len(MANIFESTS) >= 10


@pytest.mark.parametrize(("name", "doc"), MANIFESTS, ids=[n for n, _ in MANIFESTS])
def test_manifest_is_valid_kubernetes(name: str, doc: dict[str, Any]) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRDS:
        assert doc["metadata"].get("name") and isinstance(doc.get("spec"), dict), name
        return
    # strict: a misspelt or misplaced field is an error, not silently ignored by the API server
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_catches_a_broken_manifest() -> None:
    """What the test above relies on: a wrong type, an unknown field and a missing required one fail."""
    deployment = copy.deepcopy(next(d for _, d in MANIFESTS if d["kind"] == "Deployment"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for break_it in (lambda c: c.update(ports=[{"containerPort": "eighty"}]),
                     lambda c: c.update(imagePullPolicyy="Always"),
                     lambda c: c.pop("name")):
        broken = copy.deepcopy(deployment)
        break_it(broken["spec"]["template"]["spec"]["containers"][0])
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    assert container  # the original is untouched


def test_every_trainyard_workload_is_scraped_by_prometheus() -> None:
    """Each Deployment and DaemonSet of a trainyard component asks deploy/k8s/prometheus.yaml to scrape it on
    TRAINYARD_METRICS_PORT (the ConfigMap's), so no service's metrics go missing from the dashboards."""
    config = next(d for _, d in MANIFESTS if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "trainyard-config")
    port = config["data"]["TRAINYARD_METRICS_PORT"]
    workloads = {d["metadata"]["name"]: d for _, d in MANIFESTS if d["kind"] in ("Deployment", "DaemonSet")}
    assert {"api", "telemetry", "scheduler", "checkpoint-coordinator", "registry", "node-agent",
            "prometheus"} <= set(workloads)
    for name, workload in workloads.items():
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if name == "prometheus":
            assert "prometheus.io/scrape" not in annotations
            continue
        assert annotations.get("prometheus.io/scrape") == "true" and annotations.get("prometheus.io/port") == port, name


def test_kustomization_lists_existing_manifests() -> None:
    """kustomize's own schema is not Kubernetes': its resources exist and it installs every manifest but the
    operator CRs (kafka-users.yaml is applied with the Kafka operator, deploy/k8s/README.md)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = set(kustomization["resources"])
    assert all((K8S / r).is_file() for r in resources), resources
    crd_files = {n.split(":")[0] for n, d in MANIFESTS if (d["apiVersion"], d["kind"]) in CRDS}
    assert resources == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} - crd_files


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.protocols.Validator:
    raw = COMPOSE_SCHEMA.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == COMPOSE_SCHEMA_SHA256, "update deploy/compose/schema/README.md"
    schema = json.loads(raw)
    jsonschema.Draft201909Validator.check_schema(schema)  # the draft it declares
    return jsonschema.Draft201909Validator(schema)


def test_compose_file_is_valid(compose_validator: jsonschema.protocols.Validator) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    errors = sorted(compose_validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_compose_validation_catches_mistakes(compose_validator: jsonschema.protocols.Validator) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    for path, value in ((("services", "api", "portz"), ["8080:8080"]),
                        (("services", "api", "depends_on", "kafka", "condition"), "service_ready"),
                        (("services", "grafana", "volumes"), "not-a-list")):
        broken = copy.deepcopy(compose)
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert list(compose_validator.iter_errors(broken)), path


def test_compose_mounts_exist() -> None:
    """Every host path the compose file mounts (relative to it) is in the repository, but the credentials
    `trainyard admin credentials redis` writes before `up`."""
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith(".") and "redis-credentials" not in source:
                assert (COMPOSE.parent / source).exists(), f"{name}: {source}"
