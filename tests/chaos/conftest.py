import os

import pytest

LONG = os.environ.get("TRAINYARD_LONG_TESTS") == "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/chaos" in str(item.fspath) and item.get_closest_marker("long") and not LONG:
            item.add_marker(pytest.mark.skip(reason="long chaos run: `make chaos` (TRAINYARD_LONG_TESTS=1)"))
