"""deploy/k8s/kafka-users.yaml against the contract: each trainyard service's broker user may write the topics
it publishes and read the topics (and groups) it consumes, as contract.FLOWS says; the downstream example user
may read the public feeds (trainyard.registry, trainyard.jobs) in its own group, and write nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from trainyard_contract import events as ev
from trainyard_contract.asyncapi import FLOWS

USERS = Path(__file__).parents[2] / "deploy" / "k8s" / "kafka-users.yaml"
SERVICES = {"api", "scheduler", "checkpoint-coordinator", "registry", "node-agent"}
DOWNSTREAM = "downstream-eval"


def acls() -> dict[str, list[dict[str, Any]]]:
    docs = [d for d in yaml.safe_load_all(USERS.read_text()) if d]
    return {d["metadata"]["name"]: d["spec"]["authorization"]["acls"] for d in docs if d["kind"] == "KafkaUser"}


def allowed(rules: list[dict[str, Any]], kind: str, name: str, operation: str) -> bool:
    """Strimzi's simple authorization for one resource: a literal or prefix rule that grants the operation."""
    for rule in rules:
        resource = rule["resource"]
        if resource["type"] != kind or operation not in rule["operations"]:
            continue
        pattern = resource.get("patternType", "literal")
        if (pattern == "literal" and resource["name"] in (name, "*")) or (
                pattern == "prefix" and name.startswith(resource["name"])):
            return True
    return False


@pytest.mark.parametrize("event", sorted(FLOWS, key=lambda e: e.__name__), ids=lambda e: e.__name__)
def test_each_service_may_write_what_it_publishes_and_read_what_it_consumes(event: type[ev.Event]) -> None:
    users, flow = acls(), FLOWS[event]
    for producer in flow.producers:
        if producer.party in SERVICES:
            assert allowed(users[f"trainyard-{producer.party}"], "topic", event.topic, "Write"), (producer, event)
    for consumer in flow.consumers:
        if consumer.party in SERVICES:
            rules = users[f"trainyard-{consumer.party}"]
            assert allowed(rules, "topic", event.topic, "Read"), (consumer, event)
            assert consumer.group is None or allowed(rules, "group", f"trainyard.{consumer.group}", "Read")


def test_the_registry_writes_the_feed_and_a_downstream_user_only_reads_the_public_topics() -> None:
    users = acls()
    assert allowed(users["trainyard-registry"], "topic", ev.REGISTRY, "Write")
    downstream = users[DOWNSTREAM]
    public_topics = {event.topic for event, flow in FLOWS.items() if flow.public and event.topic != ev.DATASETS}
    assert public_topics == {ev.REGISTRY, ev.JOBS}
    for topic in ev.ALL_TOPICS:
        assert allowed(downstream, "topic", topic, "Read") == (topic in public_topics), topic
        assert not allowed(downstream, "topic", topic, "Write"), topic
    assert allowed(downstream, "group", DOWNSTREAM, "Read")
    assert not allowed(downstream, "group", "trainyard.registry", "Read")  # not the platform's groups
