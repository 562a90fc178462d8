"""`trainyard submit --code DIR` as a user types it, against the real API process (over the suite's broker
and Redis): a git checkout with a .gitignore'd file and an uncommitted change is packed, uploaded once,
and the job's spec names its commit, dirty=true and the archive, which lacks the ignored file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from trainyard_contract import codetree
from trainyard_contract.storage import ArtifactLayout
from tests.support.api import TOKEN_A, api_in_thread, spec_with

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV, "HOME": str(repo)}).stdout.strip()


def trainyard(url: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINYARD_TOKEN", "TRAINYARD_API_URL")}
    return subprocess.run([sys.executable, "-m", "trainyard_cli", "--api-url", url, "--token", TOKEN_A, *args],
                          cwd=cwd, env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_submit_code_packs_a_dirty_checkout_without_its_ignored_files(env: dict, tmp_path: Path) -> None:
    project = tmp_path / "my-project"
    project.mkdir()
    (project / "train.py").write_text("print('step 1')\n")
    (project / ".gitignore").write_text("secrets.env\n")
    (project / "secrets.env").write_text("TOKEN=do-not-upload\n")
    git(project, "init", "-q", "-b", "main")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "first")
    head = git(project, "rev-parse", "HEAD")
    (project / "train.py").write_text("print('step 2, not committed')\n")
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec_with(name="my-code")))

    with api_in_thread(env) as url:
        first = trainyard(url, tmp_path, "submit", str(spec_file), "--code", str(project),
                          "--entrypoint", "python train.py --lr 3e-4")
        assert first.returncode == 0, first.stderr
        assert "uploaded" in first.stderr and "(dirty)" in first.stderr
        job_id = first.stdout.split()[1]

        shown = trainyard(url, tmp_path, "jobs", "get", job_id, "--json")
        assert shown.returncode == 0, shown.stderr
        code = json.loads(shown.stdout)["spec"]["code"]
        assert (code["commit"], code["dirty"]) == (head, True)
        assert code["entrypoint"] == ["python", "train.py", "--lr", "3e-4"]

        table = trainyard(url, tmp_path, "jobs", "get", job_id)
        assert code["archive"] in table.stdout and f"{head} (dirty)" in table.stdout
        assert "python train.py --lr 3e-4" in table.stdout

        # the same tree again: found by its address, not uploaded twice
        again = trainyard(url, tmp_path, "submit", str(spec_file), "--code", str(project),
                          "--entrypoint", "python train.py --lr 3e-4")
        assert again.returncode == 0 and "already uploaded" in again.stderr, again.stderr

        no_entrypoint = trainyard(url, tmp_path, "submit", str(spec_file), "--code", str(project))
        assert no_entrypoint.returncode == 2 and "--entrypoint" in no_entrypoint.stderr

    stored = ArtifactLayout(env["artifact_root"]).code_archive("tenant-a", codetree.archive_hex(code["archive"]))
    digest = codetree.extract(stored.read_bytes(), tmp_path / "unpacked")
    assert set(digest.files) == {"train.py", ".gitignore"}  # secrets.env is ignored, .git never packed
    assert (tmp_path / "unpacked" / "train.py").read_text() == "print('step 2, not committed')\n"
