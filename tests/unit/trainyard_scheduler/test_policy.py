"""The queue policy file: YAML or JSON, camelCase, defaults, errors that name the field."""

from __future__ import annotations

import pytest

from trainyard_contract.errors import ConfigError
from trainyard_scheduler.policy import UNLIMITED, QueueConfig, dump_queue_config, parse_queue_config

YAML = """
priorityClasses:
  - {name: low, value: -100}
  - {name: normal, value: 0}
  - {name: urgent, value: 500}
tenants:
  research:
    cohort: lab
    weight: 2
    maxPriority: 100
    quotas:
      h100-80gb: {guaranteed: 512, borrowLimit: 256}
      "*": {guaranteed: 0}
defaultTenant:
  quotas: {"*": {guaranteed: 8, borrowLimit: 0}}
cohorts:
  lab: {limits: {h100-80gb: 1024}}
aging: {everySeconds: 600, step: 5, maxBoost: 50}
preemption: {checkpointGraceSeconds: 120, maxPerPass: 1}
backfill: false
"""


def test_yaml_round_trip_and_lookups() -> None:
    config = parse_queue_config(YAML)
    assert config.guaranteed("research", "h100-80gb") == 512
    assert config.cap("research", "h100-80gb") == 768
    assert config.cap("research", "a100") == UNLIMITED  # guaranteed 0, no borrow limit
    assert config.guaranteed("research", "a100") == 0
    assert (config.guaranteed("someone", "h100-80gb"), config.cap("someone", "h100-80gb")) == (8, 8)
    assert config.cohort_limit("lab", "h100-80gb") == 1024 and config.cohort_limit("lab", "cpu") == UNLIMITED
    assert config.cohort_limit("default", "h100-80gb") == UNLIMITED
    assert config.priority("research", 900) == 100 and config.priority("other", 900) == 900
    assert [config.class_of(p) for p in (-500, -100, 0, 499, 500, 1000)] == \
        ["low", "low", "normal", "normal", "urgent", "urgent"]
    assert [config.boost(s) for s in (0, 599, 600, 1800, 10**6)] == [0, 0, 5, 15, 50]
    assert config.preemption.checkpoint_grace_seconds == 120 and config.preemption.enabled
    assert config.backfill is False and config.tenant("research").weight == 2
    assert parse_queue_config(dump_queue_config(config)) == config  # what the Redis key holds


def test_empty_means_defaults_unlimited() -> None:
    for text in ("", "{}", "null"):
        config = parse_queue_config(text)
        assert config == QueueConfig()
        assert config.cap("anyone", "h100") == UNLIMITED
        assert config.class_of(0) == "normal" and config.class_of(1000) == "critical"


@pytest.mark.parametrize(("text", "fragment"), [
    ("tenants: {a: {weight: 0}}", "tenants.a.weight"),
    ("tenants: {a: {quotas: {h100: {guaranteed: -1}}}}", "tenants.a.quotas.h100.guaranteed"),
    ("surprise: 1", "surprise"),
    ("- just\n- a list", "expected a mapping"),
    ("tenants: [unclosed", "not valid YAML/JSON"),
])
def test_bad_config_names_the_field(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="queue config") as info:
        parse_queue_config(text)
    assert fragment in str(info.value)


def test_a_tenants_stored_settings_win_and_the_document_only_seeds() -> None:
    from trainyard_scheduler.policy import tenant_seeds, with_tenant_settings

    base = parse_queue_config("tenants: {a: {quotas: {cpu: {guaranteed: 4, borrowLimit: 0}}}, b: {weight: 2}}\n"
                              "priorityClasses: [{name: low, value: -1}, {name: top, value: 50}]\n")
    seeds = tenant_seeds(base, stored={"b"})
    assert set(seeds) == {"a"}  # b has settings of its own: the file does not touch them
    stored = {**seeds, "b": '{"weight": 5, "maxPriority": 10}', "c": '{"quotas": {"cpu": {"guaranteed": 1}}}'}
    config, problems = with_tenant_settings(base, stored)
    assert problems == []
    assert config.cap("a", "cpu") == 4  # the seed is the file's entry
    assert config.tenant("b").weight == 5 and config.priority("b", 100) == 10 and config.class_of(10) == "low"
    assert config.guaranteed("c", "cpu") == 1  # a tenant created through the API, not in the file
    assert config.priority_classes == base.priority_classes  # the document's other parts stay


def test_an_unreadable_stored_entry_is_named_and_the_document_entry_kept() -> None:
    from trainyard_scheduler.policy import with_tenant_settings

    base = parse_queue_config("tenants: {a: {weight: 3}}\n")
    config, problems = with_tenant_settings(base, {"a": '{"weight": -1}', "z": "not json"})
    assert config.tenant("a").weight == 3 and "z" not in config.tenants
    assert len(problems) == 2 and "'a'" in problems[0] and "weight" in problems[0] and "'z'" in problems[1]
    unchanged, none = with_tenant_settings(base, {})
    assert unchanged == base and none == []


def test_a_tenant_deleted_through_the_api_is_not_seeded_again_from_the_document() -> None:
    from trainyard_contract.records import DELETED_TENANT_SETTINGS
    from trainyard_scheduler.policy import tenant_seeds, with_tenant_settings

    base = parse_queue_config("tenants: {a: {weight: 3}, b: {weight: 2}}\n")
    stored = {"a": DELETED_TENANT_SETTINGS}
    assert set(tenant_seeds(base, stored=set(stored))) == {"b"}
    config, problems = with_tenant_settings(base, {**stored, "b": '{"weight": 2}'})
    assert problems == [] and "a" not in config.tenants and config.tenant("b").weight == 2
