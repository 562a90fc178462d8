"""Control-plane credentials: SASL for the broker (faststream and the admin client configured alike),
a SASL protocol without a user refused at start-up, and passwords never printed."""

from __future__ import annotations

from pathlib import Path

import pytest
from faststream.security import SASLScram256, SASLScram512

from trainyard_runtime.bus import KafkaAuth
from trainyard_contract.errors import ConfigError
from trainyard_contract.settings import ServiceSettings, load_settings, redacted


def test_plaintext_needs_nothing() -> None:
    auth = KafkaAuth.from_settings(load_settings(ServiceSettings))
    assert auth.security() is None and auth.client_options() == {}


def test_sasl_users_reach_both_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("TRAINYARD_KAFKA_SASL_USERNAME", "scheduler")
    monkeypatch.setenv("TRAINYARD_KAFKA_SASL_PASSWORD", "s3cret")
    settings = load_settings(ServiceSettings)
    assert "s3cret" not in repr(settings)  # a SecretStr
    auth = KafkaAuth.from_settings(settings)
    security = auth.security()
    assert isinstance(security, SASLScram512) and security.use_ssl
    options = auth.client_options()
    assert (options["security_protocol"], options["sasl_mechanism"], options["sasl_plain_username"],
            options["sasl_plain_password"]) == ("SASL_SSL", "SCRAM-SHA-512", "scheduler", "s3cret")
    assert options["ssl_context"] is not None
    monkeypatch.setenv("TRAINYARD_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("TRAINYARD_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    plain = KafkaAuth.from_settings(load_settings(ServiceSettings))
    assert isinstance(plain.security(), SASLScram256) and plain.client_options()["ssl_context"] is None


def test_a_sasl_protocol_without_a_user_is_refused_naming_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    with pytest.raises(ConfigError, match="TRAINYARD_KAFKA_SASL_USERNAME and TRAINYARD_KAFKA_SASL_PASSWORD"):
        load_settings(ServiceSettings)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://scheduler:s3cret@redis:6379/0", "redis://scheduler:***@redis:6379/0"),
    ("redis://:s3cret@127.0.0.1:6390/0", "redis://:***@127.0.0.1:6390/0"),
    ("redis://127.0.0.1:6390/0", "redis://127.0.0.1:6390/0"),
])
def test_passwords_are_redacted(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_checkpoint_files_behind_a_symbolic_link_are_refused(tmp_path: Path) -> None:
    """A rank could swap a shard it reported for a link to another tenant's file: root services that
    hash checkpoint files refuse any path with a link in it."""
    from trainyard_contract.errors import StateStoreError
    from trainyard_contract.manifest import local_sha256, local_stat_size

    secret = tmp_path / "other-tenant" / "shard"
    secret.parent.mkdir()
    secret.write_bytes(b"theirs")
    own = tmp_path / "job" / "checkpoints" / "step-1"
    own.mkdir(parents=True)
    (own / "__0_0.distcp").symlink_to(secret)
    (tmp_path / "job" / "checkpoints" / "step-2").symlink_to(secret.parent, target_is_directory=True)
    (own / "real.distcp").write_bytes(b"mine")
    assert local_stat_size((own / "real.distcp").as_uri()) == 4
    assert len(local_sha256((own / "real.distcp").as_uri())) == 64
    for uri in ((own / "__0_0.distcp").as_uri(), (tmp_path / "job" / "checkpoints" / "step-2" / "shard").as_uri()):
        with pytest.raises(StateStoreError, match="symbolic link"):
            local_stat_size(uri)
        with pytest.raises(StateStoreError, match="symbolic link"):
            local_sha256(uri)
