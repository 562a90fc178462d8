"""The pure decisions about users' code: an upload names its own bytes within the limit, a spec's
archive must be known, a resolved revision pins the spec (and changes its hash), repo kinds."""

from __future__ import annotations

import pytest

from trainyard_api.code import (
    ArchiveTooLargeError,
    GitSource,
    code_problems,
    is_local,
    is_remote,
    pinned,
    resolution_problems,
    upload_problem,
)
from trainyard_api.schemas import EXAMPLE_SPEC
from trainyard_contract.errors import SpecError
from trainyard_contract.spec import TrainingSpec

HEX = "ab" * 32
ARCHIVE = f"sha256:{HEX}"


def spec(**code: object) -> TrainingSpec:
    return TrainingSpec.model_validate({**EXAMPLE_SPEC, "code": {"entrypoint": ["python", "t.py"], **code}})


def test_an_upload_must_be_within_the_limit_and_name_its_own_sha256() -> None:
    assert upload_problem(ARCHIVE, HEX, 10, 10) is None
    too_big = upload_problem(ARCHIVE, HEX, 11, 10)
    assert isinstance(too_big, ArchiveTooLargeError) and "at most 10 bytes" in too_big.detail
    mismatch = upload_problem("sha256:" + "0" * 64, HEX, 10, 10)
    assert mismatch is not None and not isinstance(mismatch, ArchiveTooLargeError)
    assert mismatch.field == "path.archive" and ARCHIVE in mismatch.detail


def test_a_spec_may_name_only_an_archive_its_tenant_uploaded() -> None:
    assert code_problems(spec(archive=ARCHIVE), archive_known=True) == []
    [problem] = code_problems(spec(archive=ARCHIVE), archive_known=False)
    assert problem.field == "code.archive" and "trainyard submit --code" in problem.message
    assert code_problems(spec(repo="/r", revision="main"), archive_known=False) == []  # the API archives it
    assert code_problems(TrainingSpec.model_validate(EXAMPLE_SPEC), archive_known=False) == []


def test_a_resolved_revision_pins_the_spec_and_its_hash() -> None:
    submitted = spec(repo="/r", revision="main")
    stored = pinned(submitted, commit="c" * 40, archive=ARCHIVE)
    assert stored.code is not None and (stored.code.commit, stored.code.archive) == ("c" * 40, ARCHIVE)
    assert (stored.code.repo, stored.code.revision) == ("/r", "main")
    assert stored.spec_hash() != submitted.spec_hash()
    assert stored.spec_hash() == TrainingSpec.model_validate(stored.wire()).spec_hash()  # the stored JSON says it all


def test_a_repo_spec_naming_another_commit_or_archive_is_refused() -> None:
    same = spec(repo="/r", revision="main", commit="c" * 40, archive=ARCHIVE)
    assert resolution_problems(same, commit="c" * 40, archive=ARCHIVE) == []
    problems = resolution_problems(same, commit="d" * 40, archive="sha256:" + "0" * 64)
    assert [p.field for p in problems] == ["code.commit", "code.archive"]


@pytest.mark.parametrize("repo, remote, local", [
    ("https://github.com/a/b.git", True, False),
    ("ssh://git@host/a/b", True, False),
    ("git@github.com:a/b.git", True, False),
    ("file:///srv/repo", True, True),
    ("/srv/repo", False, True),
    ("/srv/user@host:x", False, True),
])
def test_repo_kinds(repo: str, remote: bool, local: bool) -> None:
    assert (is_remote(repo), is_local(repo)) == (remote, local)


def test_without_local_repositories_a_path_or_file_url_is_refused_before_git_runs() -> None:
    git = GitSource(local_repos=False)
    for repo in ("/srv/repo", "file:///srv/repo"):
        with pytest.raises(SpecError) as caught:
            git.resolve(repo, "main")
        assert caught.value.field == "code.repo" and "TRAINYARD_API_GIT_LOCAL_REPOS" in caught.value.detail
    with pytest.raises(SpecError) as caught:
        git.resolve("https://example.invalid/r.git", "--upload-pack=evil")
    assert caught.value.field == "code.revision"
