"""Parsing TRAINYARD_REDIS_URL: one server, or Sentinels and the service they fail over."""

from __future__ import annotations

import pytest

from trainyard_contract.errors import ConfigError
from trainyard_runtime.replication import EpochAcks, parse_redis_url


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database() -> None:
    t = parse_redis_url("redis+sentinel://scheduler:s%40cret@10.0.0.1:26379,[::1]:26380/trainyard/3")
    assert t.is_sentinel and t.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (t.service, t.db, t.username, t.password) == ("trainyard", 3, "scheduler", "s@cret")
    assert t.acks == EpochAcks(replicas=1, timeout_ms=1000)  # through Sentinel, epochs wait for a replica


def test_our_parameters_are_read_and_taken_off() -> None:
    t = parse_redis_url("redis+sentinel://h:1/svc?epoch_acks=2&epoch_ack_timeout_ms=50&sentinel_password=x")
    assert t.acks == EpochAcks(replicas=2, timeout_ms=50) and t.sentinel_password == "x" and t.db == 0
    plain = parse_redis_url("redis://u:p@h:6379/2?epoch_acks=1&socket_timeout=5")
    assert not plain.is_sentinel and plain.acks.replicas == 1
    assert plain.url == "redis://u:p@h:6379/2?socket_timeout=5"


def test_one_server_waits_for_no_replica_by_default() -> None:
    assert parse_redis_url("redis://127.0.0.1:6390/0").acks == EpochAcks(replicas=0)


@pytest.mark.parametrize("url", [
    "redis+sentinel://h:1",  # no service
    "redis+sentinel://h:1/svc/0/extra",
    "redis+sentinel://h/svc",  # no port
    "redis+sentinel://h:x/svc",
    "redis+sentinel://h:1/svc/db",
    "redis://h:1/0?epoch_acks=-1",
    "redis://h:1/0?epoch_acks=many",
])
def test_a_malformed_url_is_a_config_error_without_the_password(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_redis_url(url.replace("://", "://u:secret@"))
    assert "secret" not in str(caught.value)
