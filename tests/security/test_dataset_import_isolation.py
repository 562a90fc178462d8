"""A tenant's ``trainyard datasets import`` stays under that tenant, through the real API (broker, Redis).

Without ``--publish`` as with it, the version is written under the token's tenant's prefix — never the
platform's ``datasets/`` (where the platform's own import of the same name would collide with it, or could be
shadowed by it), never another tenant's. The tenant is the API's answer for the token, not an option a user
picks: ``--tenant`` is no option of this command. Two tenants and the platform import the same name@version from
different data; each gets its own version, and none changes another's bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from trainyard_api import ApiServer
from trainyard_cli.main import app
from trainyard_contract.storage import ArtifactLayout, sha256_file
from trainyard_trainer.data_cli import main as data_main

from tests.support.api import TOKEN_A, TOKEN_B, running_api

pytestmark = [pytest.mark.integration, pytest.mark.security]
A, B = "tenant-a", "tenant-b"  # the tenants of TOKEN_A and TOKEN_B


@pytest.fixture
async def api(env: dict[str, Any]) -> AsyncIterator[ApiServer]:
    async with running_api(env) as server:
        yield server


def corpus(tmp_path: Path, text: str) -> str:
    path = tmp_path / f"{text.split()[0]}.jsonl"
    path.write_text("".join(json.dumps({"text": f"{text} {i}"}) + "\n" for i in range(20)))
    return str(path)


async def test_a_tenants_import_without_publish_stays_under_its_tenant_and_collides_with_nobody(
    api: ApiServer, tmp_path: Path,
) -> None:
    root = tmp_path / "artifacts"
    layout = ArtifactLayout(root)

    def cli(token: str, *args: str) -> Any:
        return CliRunner().invoke(app, ["--api-url", api.url, "--token", token, "datasets", "import", "--name",
                                        "wiki", "--version", "v1", "--artifact-root", str(root), "--workers", "1",
                                        "--vocab-size", "300", "--no-progress", *args])

    first = await asyncio.to_thread(cli, TOKEN_A, corpus(tmp_path, "alpha text"))
    assert first.exit_code == 0, first.output
    mine = layout.dataset_dir("wiki", "v1", A) / "manifest.json"
    assert json.loads(first.stdout.strip().splitlines()[-1])["manifestUri"] == mine.as_uri()
    assert not (root / "datasets").exists()  # nothing in the platform's prefix
    a_bytes = {p.name: sha256_file(p) for p in mine.parent.iterdir()}

    # the platform's import of the same name@version, other data: its own version beside it
    assert await asyncio.to_thread(data_main, [
        "import", "--name", "wiki", "--version", "v1", "--artifact-root", str(root), "--workers", "1",
        "--vocab-size", "300", "--no-progress", corpus(tmp_path, "platform words")]) == 0
    # another tenant's import of it: under that tenant, whatever it asks for
    second = await asyncio.to_thread(cli, TOKEN_B, corpus(tmp_path, "beta prose"))
    assert second.exit_code == 0, second.output
    refused = await asyncio.to_thread(cli, TOKEN_B, "--tenant", A, corpus(tmp_path, "beta prose"))
    assert refused.exit_code == 2 and "unrecognized arguments: --tenant" in refused.output, refused.output

    versions = {p.parent for p in root.rglob("manifest.json")}
    assert versions == {layout.dataset_dir("wiki", "v1"), layout.dataset_dir("wiki", "v1", A),
                        layout.dataset_dir("wiki", "v1", B)}
    assert len({sha256_file(v / "manifest.json") for v in versions}) == 3  # three versions, three contents
    assert {p.name: sha256_file(p) for p in mine.parent.iterdir()} == a_bytes  # A's untouched
