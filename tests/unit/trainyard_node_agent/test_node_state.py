"""Where a node keeps its own files: the artifact root when it is a directory (nothing moves), a node state
directory when the artifact root is an object store; what ranks are told about both."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.settings import RankSettings
from trainyard_contract.errors import ConfigError
from trainyard_contract.storage import ArtifactLayout, ObjectPath
from trainyard_node_agent.admission import rank_env
from trainyard_node_agent.confinement import Confinement
from trainyard_node_agent.settings import DEFAULT_NODE_STATE_DIR, NodeAgentSettings

from tests.unit.trainyard_node_agent.test_admission import gang


def test_a_local_artifact_root_keeps_the_nodes_files_where_they_were(tmp_path: Path) -> None:
    s = NodeAgentSettings(node_id="n1", artifact_root=tmp_path / "art")
    assert s.local_root == (tmp_path / "art").resolve()
    assert s.agent_state_path == (tmp_path / "art").resolve() / "nodes" / "n1" / "agent-ranks.json"
    assert s.shard_cache_path == s.agent_state_path.parent / "shard-cache"
    assert s.code_cache_path == s.agent_state_path.parent / "code-cache"


def test_an_object_store_root_keeps_them_in_the_node_state_dir(tmp_path: Path) -> None:
    s = NodeAgentSettings(node_id="n1", artifact_root="s3://bucket/prefix", node_state_dir=tmp_path / "state")
    assert s.artifact_root == "s3://bucket/prefix" and s.local_root == (tmp_path / "state").resolve()
    assert s.agent_state_path == (tmp_path / "state").resolve() / "nodes" / "n1" / "agent-ranks.json"
    unset = NodeAgentSettings(node_id="n1", artifact_root="s3://bucket/prefix")
    assert unset.local_root == DEFAULT_NODE_STATE_DIR.resolve()
    assert NodeAgentSettings(node_id="n1", shard_cache_dir=tmp_path / "c").shard_cache_path == tmp_path / "c"


@pytest.mark.parametrize(("raw", "names"), [
    ("AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]),
    ('["A", "B"]', ["A", "B"]), ("", []),
])
def test_rank_pass_env_is_a_list_of_names(raw: str, names: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_RANK_PASS_ENV", raw)
    assert NodeAgentSettings(node_id="n1").rank_pass_env == names


def test_the_sandbox_refuses_an_object_store_root_and_hides_the_nodes_own_files(tmp_path: Path) -> None:
    s = NodeAgentSettings(node_id="n1", artifact_root="s3://bucket/prefix", node_state_dir=tmp_path / "state")
    confinement = Confinement(s, ArtifactLayout(s.artifact_root), ArtifactLayout(s.local_root))
    with pytest.raises(ConfigError, match="trusted-single-tenant"):
        confinement.check()
    assert (tmp_path / "state").resolve() in confinement.hidden and s.shard_cache_path.resolve() in confinement.hidden
    trusted = s.model_copy(update={"node_sandbox": "trusted-single-tenant"})
    Confinement(trusted, ArtifactLayout(s.artifact_root), ArtifactLayout(s.local_root)).check()  # a warning only


def test_ranks_are_told_the_store_and_the_nodes_directories(tmp_path: Path) -> None:
    event = gang()
    share = event.nodes[0]
    env = rank_env(event, share, share.ranks[0], base_env={}, backend="gloo",
                   artifact_root=ObjectPath.parse("s3://bucket/prefix"), allocation_file=tmp_path / "a.json",
                   events_file=tmp_path / "e.jsonl", traceparent=None, node_state_dir=tmp_path / "state",
                   shard_cache_dir=tmp_path / "cache")
    assert env["TRAINYARD_ARTIFACT_ROOT"] == "s3://bucket/prefix"
    assert env["TRAINYARD_NODE_STATE_DIR"] == str(tmp_path / "state")
    assert env["TRAINYARD_SHARD_CACHE_DIR"] == str(tmp_path / "cache")


def test_ranks_are_told_the_shard_caches_bounds_and_read_them(tmp_path: Path) -> None:
    event = gang()
    share = event.nodes[0]
    common = dict(base_env={}, backend="gloo", artifact_root=ObjectPath.parse("s3://bucket/prefix"),
                  allocation_file=tmp_path / "a.json", events_file=tmp_path / "e.jsonl", traceparent=None,
                  node_state_dir=tmp_path / "state", shard_cache_dir=tmp_path / "cache")
    env = rank_env(event, share, share.ranks[0], shard_cache_bounds=(50.0, 2.5), **common)
    assert (env["TRAINYARD_SHARD_CACHE_MAX_GB"], env["TRAINYARD_SHARD_CACHE_MIN_FREE_GB"]) == ("50.0", "2.5")
    rank = RankSettings.model_validate(env)
    assert (rank.shard_cache_max_gb, rank.shard_cache_min_free_gb) == (50.0, 2.5)
    unbounded = rank_env(event, share, share.ranks[0], shard_cache_bounds=(None, 1.0), **common)
    assert "TRAINYARD_SHARD_CACHE_MAX_GB" not in unbounded
    assert RankSettings.model_validate(unbounded).shard_cache_max_gb is None
