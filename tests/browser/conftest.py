"""Headless Chromium (Debian's ``chromium`` + ``chromium-driver``, installed by ``make deps``) through
Selenium, at a laptop's 1366x768, with the browser console recorded."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/browser" in str(item.fspath):
            item.add_marker(pytest.mark.browser)
            item.add_marker(pytest.mark.e2e)


def _executable(env: str, *names: str) -> str:
    for candidate in (os.environ.get(env), *names):
        if candidate and (found := shutil.which(candidate)):
            return found
    pytest.fail(f"the browser tests need {' or '.join(names)}: `make deps` installs Debian's chromium and "
                f"chromium-driver (scripts/ensure-system-deps.sh), or set {env} to the executable")


@pytest.fixture(scope="module")
def driver() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _executable("TRAINYARD_CHROMIUM", "chromium", "chromium-browser", "google-chrome")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1366,768", "--lang=en-GB"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=Service(_executable("TRAINYARD_CHROMEDRIVER", "chromedriver")), options=options)
    try:
        yield browser
    finally:
        browser.quit()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the pages' screenshots go: ``TRAINYARD_SCREENSHOTS`` (e.g. docs/images to refresh the committed
    copies), else a directory under pytest's temporary root (a test artefact)."""
    configured = os.environ.get("TRAINYARD_SCREENSHOTS")
    path = Path(configured) if configured else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path
