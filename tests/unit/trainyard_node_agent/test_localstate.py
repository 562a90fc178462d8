"""The node-local rank table: merge of the Redis and local copies, atomic and throttled writes."""

from __future__ import annotations

import json
from pathlib import Path

from trainyard_node_agent.localstate import LocalState, merge_tables
from trainyard_node_agent.ranks import RankProcess
from trainyard_node_agent.watchdog import Liveness


def test_merge_prefers_the_copy_that_published_more() -> None:
    redis = {"a/0": {"offset": 10, "pid": 1}, "a/1": {"offset": 5, "pid": 2}}
    local = {"a/0": {"offset": 30, "pid": 1}, "b/0": {"offset": 0, "pid": 3}}
    merged = merge_tables(redis, local)
    assert {k: v["offset"] for k, v in merged.items()} == {"a/0": 30, "a/1": 5, "b/0": 0}


def test_save_is_throttled_unless_forced_and_load_survives_garbage(tmp_path: Path) -> None:
    state = LocalState(tmp_path / "n" / "ranks.json", min_interval_s=60)
    state.save({"a/0": {"offset": 1}}, force=True)
    state.save({"a/0": {"offset": 2}})
    assert state.dirty and state.load() == {"a/0": {"offset": 1}}
    state.save({"a/0": {"offset": 2}}, force=True)
    assert not state.dirty and state.load() == {"a/0": {"offset": 2}}
    (tmp_path / "n" / "ranks.json").write_text("{not json")
    assert state.load() == {}
    assert LocalState(tmp_path / "missing.json").load() == {}


def test_a_rank_round_trips_through_its_persisted_form(tmp_path: Path) -> None:
    from trainyard_contract.spool import SpoolReader

    rank = RankProcess(job_id="j", tenant="t", attempt=2, allocation_id="al", epoch=5, rank=1, local_rank=1,
                       pid=4321, log_path=tmp_path / "log", spool=SpoolReader(tmp_path / "spool", 77),
                       traceparent=None, exit_file=tmp_path / "exit" / "rank-1.json", device_index=3, pgid=4320,
                       start_ticks=123456, liveness=Liveness(0.0, reported=True))
    again = RankProcess.from_persisted(json.loads(json.dumps(rank.persisted("boot"))))
    for name in ("job_id", "attempt", "allocation_id", "epoch", "rank", "pid", "pgid", "start_ticks",
                 "device_index", "exit_file", "progressed"):
        assert getattr(again, name) == getattr(rank, name), name
    assert again.spool.offset == 77 and again.spool.path == rank.spool.path
