"""A planned stop is not a failure: `trainyard dev down` (what `make down` runs) while two jobs train drains
them — their ranks checkpoint at an agreed step and stop, interrupted by maintenance — and after
`trainyard dev up` both resume from that checkpoint by themselves; no node is blamed or quarantined and no
failure budget is spent. Then SIGTERM to one node agent drains only its node: its attempt resumes on the
other node from the drain checkpoint, and the agent's restart ends the drain. The commands run as a user
types them, on a fresh state directory."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cli import LocalCli
from trainyard_contract.records import JobRecord
from trainyard_runtime.store import Keys, StateStore, connect_redis
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def redis_read(url: str, read: Callable[[StateStore], Any]) -> Any:
    async def go() -> Any:
        redis = connect_redis(url)
        try:
            return await read(StateStore(redis))
        finally:
            await redis.aclose()

    return asyncio.run(go())


def up_and_submit_two(trainyard: LocalCli, spec_file: Path) -> list[str]:
    """`trainyard dev up`, then the spec submitted twice; the two job ids."""
    up = trainyard("dev", "up", timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    ids = []
    for _ in range(2):
        submitted = trainyard("submit", str(spec_file))
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        ids.append(re.search(r"submitted (job-[0-9a-f]+)", submitted.stdout).group(1))  # type: ignore[union-attr]  # present here (the test asserts it)
    return ids


def drain_cli(tmp_path: Path) -> LocalCli:
    """The local stack for these tests, without straggler detection: they hold that maintenance blames no
    node, and on a CI host shared with other tests' ranks a rank can really run 1.5x slower than its peer for
    a minute — a straggler report (a node score) that belongs to another feature
    (tests/integration/test_scheduler_health.py), not to draining."""
    cli = LocalCli(tmp_path, nodes=2)
    cli.env["TRAINYARD_STRAGGLER_DETECTION"] = "false"
    return cli


def test_make_down_drains_running_jobs_and_make_up_resumes_them(tmp_path: Path) -> None:
    trainyard = drain_cli(tmp_path)
    url = trainyard.redis_url
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["training"]["maxSteps"] = 100_000  # trains until the test is done with it
    spec["checkpointPolicy"]["everySteps"] = 10
    spec_file = tmp_path / "long.yaml"
    spec_file.write_text(yaml.safe_dump(spec))

    def jobs(ids: list[str]) -> list[JobRecord]:
        return redis_read(url, lambda s: s.get_jobs(ids))

    job_ids: list[str] = []
    try:
        job_ids += up_and_submit_two(trainyard, spec_file)

        def training() -> bool:  # both run and have a READY checkpoint: the ranks are past start-up
            ready = redis_read(url, lambda s: asyncio.gather(*(s.latest_ready_checkpoint(j) for j in job_ids)))
            return all(j.state == "running" for j in jobs(job_ids)) and all(r is not None for r in ready)

        wait_for(training, "both jobs training with a READY checkpoint", 300)

        down = trainyard("dev", "down", timeout=400)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "draining: 2 running attempt(s) checkpoint and stop" in down.stderr, down.stderr
        assert "2 attempt(s) interrupted by maintenance (no failure)" in down.stderr, down.stderr

        again = trainyard("dev", "up", timeout=600)
        assert again.returncode == 0, again.stdout + again.stderr

        def resumed() -> list[JobRecord] | None:
            got = jobs(job_ids)
            ok = all(len(j.attempts) >= 2 and j.state == "running" and j.attempts[1].started_ranks for j in got)
            return got if ok else None

        for job in wait_for(resumed, "both jobs running their second attempt", 300):
            first, second = job.attempts[0], job.attempts[1]
            assert first.state == "revoked", first
            assert (first.interruption or "").startswith("maintenance: node"), first
            assert first.ready_step_at_end is not None
            ckpts = redis_read(url, lambda s, j=job.job_id: s.list_checkpoints(j))
            ready_of_first = [c for c in ckpts if c.state == "READY" and c.attempt == 1]
            assert ready_of_first, [(c.global_step, c.attempt, c.state, c.reason) for c in ckpts]
            drain_ckpt = max(ready_of_first, key=lambda c: c.global_step)
            assert second.start_checkpoint is not None, second
            assert second.start_checkpoint.global_step == drain_ckpt.global_step == first.ready_step_at_end
            assert sum(1 for a in job.attempts if a.state == "failed") == 0  # no failure budget spent
        assert redis_read(url, lambda s: s.redis.hgetall(Keys.node_reputation)) == {}
        assert redis_read(url, lambda s: s.redis.hgetall(Keys.node_quarantine)) == {}
        nodes = redis_read(url, lambda s: s.list_nodes())
        assert {n.node_id for n in nodes} == {"node-0", "node-1"}
        assert all(n.drained is None and n.quarantined is None for n in nodes), nodes

        # SIGTERM to one node agent drains just that node: its attempts resume on the other one
        before = {j.job_id: j for j in jobs(job_ids)}
        node = before[job_ids[0]].current.nodes[0]  # type: ignore[union-attr]  # present here (the test asserts it)
        other = "node-1" if node == "node-0" else "node-0"
        hit = [j for j in before.values() if j.current is not None and node in j.current.nodes]
        pid = int((tmp_path / ".trainyard" / "run" / f"node-agent-{node.rsplit('-', 1)[1]}.pid").read_text())
        os.kill(pid, signal.SIGTERM)

        def moved() -> list[JobRecord] | None:
            got = jobs([j.job_id for j in hit])
            ok = all(len(j.attempts) == len(before[j.job_id].attempts) + 1 and j.state == "running"
                     and j.current is not None and j.current.started_ranks for j in got)
            return got if ok else None

        for job in wait_for(moved, f"{len(hit)} job(s) resumed on {other}", 300):
            assert job.current is not None and job.current.nodes == [other], job.current
            drained = job.attempts[-2]
            assert drained.state == "revoked" and (drained.interruption or "").startswith(f"maintenance: node {node}")
            assert job.current.start_checkpoint is not None
            assert job.current.start_checkpoint.global_step == drained.ready_step_at_end
            assert sum(1 for a in job.attempts if a.state == "failed") == 0
        assert redis_read(url, lambda s: s.redis.hgetall(Keys.node_reputation)) == {}
        # `up` restarts the stopped agent: a new incarnation, so node-0 is no longer drained
        again = trainyard("dev", "up", timeout=600)
        assert again.returncode == 0, again.stdout + again.stderr
        wait_for(lambda: not redis_read(url, lambda s: s.redis.hexists(Keys.node_drain, node)),
                 f"{node} undrained by its agent's restart", 120)
    finally:
        for job_id in job_ids:
            trainyard("jobs", "cancel", job_id)
        trainyard("dev", "down", timeout=400)


def test_every_node_agent_killed_at_once_blames_no_node(tmp_path: Path) -> None:
    """kill -9 of every node agent at once (no drain: nobody said goodbye): every node goes silent together,
    which is no node's fault — the attempts are interrupted (control plane), nobody is blamed, no failure
    budget is spent, and they resume once the agents are back."""
    trainyard = drain_cli(tmp_path)
    url = trainyard.redis_url
    spec = yaml.safe_load((REPO / "examples/tiny.yaml").read_text())
    spec["training"]["maxSteps"] = 100_000
    spec["checkpointPolicy"]["everySteps"] = 10
    spec_file = tmp_path / "long.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    job_ids: list[str] = []

    def jobs() -> list[JobRecord]:
        return redis_read(url, lambda s: s.get_jobs(job_ids))

    try:
        job_ids += up_and_submit_two(trainyard, spec_file)
        wait_for(lambda: all(j.state == "running" for j in jobs()), "both jobs running", 300)

        for i in range(2):
            os.kill(int((tmp_path / ".trainyard" / "run" / f"node-agent-{i}.pid").read_text()), signal.SIGKILL)

        def interrupted() -> list[JobRecord] | None:
            got = jobs()
            return got if all(j.attempts[0].state != "running" and j.attempts[0].state != "starting"
                              for j in got) else None

        for job in wait_for(interrupted, "both attempts ended", 300):
            first = job.attempts[0]
            assert first.state == "revoked", first
            assert (first.interruption or "").startswith("control-plane: 2 of 2 nodes"), first
        assert redis_read(url, lambda s: s.redis.hgetall(Keys.node_reputation)) == {}
        assert redis_read(url, lambda s: s.redis.hgetall(Keys.node_quarantine)) == {}

        again = trainyard("dev", "up", timeout=600)  # starts the two agents again
        assert again.returncode == 0, again.stdout + again.stderr

        def resumed() -> bool:
            return all(len(j.attempts) >= 2 and j.state == "running" and j.attempts[-1].started_ranks
                       for j in jobs())

        wait_for(resumed, "both jobs running again", 300)
        for job in jobs():
            assert sum(1 for a in job.attempts if a.state == "failed") == 0, job.attempts
        assert redis_read(url, lambda s: s.redis.hgetall(Keys.node_reputation)) == {}
    finally:
        for job_id in job_ids:
            trainyard("jobs", "cancel", job_id)
        trainyard("dev", "down", timeout=400)
