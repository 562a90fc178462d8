"""Security-relevant defaults of the API's settings."""

from __future__ import annotations

from trainyard_api import ApiSettings


def test_code_repo_may_not_name_a_checkout_on_the_api_host_unless_turned_on(monkeypatch) -> None:
    monkeypatch.delenv("TRAINYARD_API_GIT_LOCAL_REPOS", raising=False)
    assert ApiSettings().api_git_local_repos is False  # any tenant could archive any checkout the API reads
    monkeypatch.setenv("TRAINYARD_API_GIT_LOCAL_REPOS", "true")  # what `make up` sets
    assert ApiSettings().api_git_local_repos is True
