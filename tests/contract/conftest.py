import pytest


@pytest.fixture(autouse=True)
def _schemathesis_node_id(request: pytest.FixtureRequest) -> None:
    """schemathesis 4.32's ``from_fixture`` tests read and write ``item._nodeid``, which pytest 9.2 renamed;
    without it they fail before sending anything. The copy only names the per-operation subtests."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid
