"""``GET /v1/admin/nodes`` shows how each node confines ranks (NodeHeartbeat.sandbox, kept in its NodeRecord)."""

from __future__ import annotations

import pytest
from trainyard_api.admin import node_view
from trainyard_contract.records import NodeRecord


@pytest.mark.parametrize("mode", ["enforce", "trusted-single-tenant", None])
def test_the_nodes_view_shows_the_sandbox_mode_its_agent_reported(mode: str | None) -> None:
    view = node_view(NodeRecord(node_id="n1", host="h", devices=[], sandbox=mode), None, None)
    assert view.sandbox == mode
    assert view.model_dump(by_alias=True, mode="json")["sandbox"] == mode
