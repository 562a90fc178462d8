"""The dashboard's files as the API serves them: the root redirects to them, every module a page imports
is served, nothing is fetched from elsewhere (it works offline), and an install carries them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from trainyard_api.dashboard import PAGES, install_dashboard

API_PACKAGE = Path(__file__).resolve().parents[3] / "services" / "api"


@pytest.fixture
def client() -> TestClient:
    app = FastAPI()
    install_dashboard(app)
    return TestClient(app)


def test_the_root_redirects_to_the_dashboard(client: TestClient) -> None:
    for path in ("/", "/ui"):
        response = client.get(path, follow_redirects=False)
        assert response.status_code == 307
        assert response.headers["location"] == "/ui/"
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert '<script type="module" src="app.js">' in page.text


def imports_of(source: str) -> set[str]:
    return set(re.findall(r'''(?:from|import)\s*["'](\./[\w.-]+)["']''', source))


def test_every_module_the_pages_import_is_served_as_javascript(client: TestClient) -> None:
    seen, todo = set(), {"./app.js"}
    while todo:
        name = todo.pop()
        seen.add(name)
        response = client.get(f"/ui/{name[2:]}")
        assert response.status_code == 200, name
        assert response.headers["content-type"].split(";")[0] in {"text/javascript", "application/javascript"}
        assert response.headers["cache-control"] == "no-cache"
        todo |= imports_of(response.text) - seen
    assert {"./api.js", "./jobs.js", "./job.js", "./cluster.js", "./lab.js", "./charts.js", "./experiments.js"} <= seen
    assert client.get("/ui/style.css").status_code == 200
    assert client.get("/ui/missing.js").status_code == 404


def test_nothing_is_loaded_from_another_origin() -> None:
    for path in PAGES.iterdir():
        text = path.read_text()
        assert not re.search(r"""(src|href)\s*=\s*["']https?://""", text), path.name
        assert not re.search(r"""(import|from)\s*["']https?://""", text), path.name
        assert "fetch(\"http" not in text and "fetch('http" not in text, path.name


def test_an_install_carries_the_pages() -> None:
    project = tomllib.loads((API_PACKAGE / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["trainyard_api"]
    files = {p.relative_to(PAGES.parent).as_posix() for p in PAGES.iterdir()}
    assert files and all(any(Path(f).match(p) for p in patterns) for f in files)
