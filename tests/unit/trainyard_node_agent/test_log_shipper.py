"""Rank logs shipped to an object store as they grow (against moto's S3 endpoint), and read back by the
API's log reader: the same bytes as the file, tailed and followed, after a restart's overlap too."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.objectstore import moto_s3
from trainyard_api.logs import RankLogs, ShippedLog
from trainyard_contract.logsegments import segment_name
from trainyard_contract.records import AttemptRecord, JobRecord
from trainyard_contract.spool import SpoolReader
from trainyard_contract.storage import ArtifactLayout, ObjectPath, list_children
from trainyard_node_agent import ranks as rp
from trainyard_node_agent.log_shipper import LogShipper, due
from tests.unit.trainyard_node_agent.test_supervisor import FakeClock


@pytest.mark.parametrize(("size", "shipped", "last_at", "now", "final", "expected"), [
    (0, 0, None, 0.0, False, False),      # nothing written
    (10, 10, 1.0, 99.0, True, False),     # all shipped, even at the end
    (10, 0, None, 0.0, False, True),      # the first bytes go at once
    (10, 5, 1.0, 2.0, False, False),      # within the interval: wait
    (10, 5, 1.0, 3.0, False, True),       # the interval passed
    (10, 5, 1.0, 1.5, True, True),        # the rank ended: everything, now
    (5 + 64, 5, 1.0, 1.5, False, True),   # a whole segment is waiting
])
def test_when_a_log_is_shipped(size: int, shipped: int, last_at: float | None, now: float, final: bool,
                               expected: bool) -> None:
    assert due(size=size, shipped=shipped, last_at=last_at, now=now, interval_s=2.0, segment_max=64,
               final=final) is expected


@pytest.fixture(scope="module")
def s3_root() -> Iterator[str]:
    with moto_s3() as root:
        yield root


def a_rank(tmp_path: Path) -> rp.RankProcess:
    return rp.RankProcess(job_id="job-1", tenant="acme", attempt=2, allocation_id="al", epoch=1, rank=1,
                          local_rank=1, pid=0, log_path=tmp_path / "rank-1.log",
                          spool=SpoolReader(tmp_path / "rank-1.jsonl"), traceparent=None,
                          exit_file=tmp_path / "exit" / "rank-1.json")


def lines(first: int, last: int) -> bytes:
    return b"".join(b"step %d loss %.3f\n" % (i, 1 / (i + 1)) for i in range(first, last))


def job_and_attempt() -> tuple[JobRecord, AttemptRecord]:
    job = JobRecord.model_construct(job_id="job-1", tenant="acme")
    return job, AttemptRecord.model_construct(attempt=2, world_size=2)


async def test_a_growing_log_is_shipped_in_segments_and_reads_back_byte_for_byte(
    tmp_path: Path, s3_root: str
) -> None:
    layout = ArtifactLayout(f"{s3_root}/ship")
    clock = FakeClock()
    shipper = LogShipper(layout, clock, interval_s=2.0, segment_max=256)
    rank = a_rank(tmp_path)
    await shipper.ship(rank)  # no file yet: nothing
    rank.log_path.write_bytes(lines(0, 10))
    await shipper.ship(rank)  # the first bytes go at once
    assert rank.log_shipped == rank.log_path.stat().st_size
    with rank.log_path.open("ab") as f:
        f.write(lines(10, 60))
    await shipper.ship(rank)  # within the interval: only whole segments
    whole = rank.log_shipped
    assert whole > len(lines(0, 10)) and (whole - len(lines(0, 10))) % 256 == 0
    clock.now += 5
    with rank.log_path.open("ab") as f:
        f.write(lines(60, 70))
    await shipper.ship(rank, final=True)
    assert rank.log_shipped == rank.log_path.stat().st_size

    logs = RankLogs(layout, poll_s=0.01)
    job, attempt = job_and_attempt()
    assert await logs.tail(job, attempt, 1, 3) == lines(67, 70)
    assert await logs.tail(job, attempt, 1, 100_000) == rank.log_path.read_bytes()
    prefix = layout.rank_log_segments("acme", "job-1", 2, 1)
    assert isinstance(prefix, ObjectPath) and len(list_children(prefix)) > 3

    async def ended() -> bool:
        return True

    followed = b"".join([chunk async for chunk in logs.follow(job, attempt, 1, 0, ended)])
    assert followed == b""  # nothing after the end
    some = ShippedLog(prefix).read_from(5)  # from inside the first segment: the rest of it
    assert some and rank.log_path.read_bytes()[5:].startswith(some)
    assert ShippedLog(prefix).read_from(rank.log_shipped) == b""


async def test_following_sees_what_is_shipped_while_it_follows(tmp_path: Path, s3_root: str) -> None:
    layout = ArtifactLayout(f"{s3_root}/follow")
    shipper = LogShipper(layout, FakeClock(), segment_max=64)
    rank = a_rank(tmp_path)
    rank.log_path.write_bytes(lines(0, 5))
    await shipper.ship(rank, final=True)
    job, attempt = job_and_attempt()
    done = asyncio.Event()

    async def ended() -> bool:
        return done.is_set()

    async def later() -> None:
        with rank.log_path.open("ab") as f:
            f.write(lines(5, 40))
        await shipper.ship(rank, final=True)
        done.set()

    stream = RankLogs(layout, poll_s=0.01).follow(job, attempt, 1, 2, ended)
    first = await anext(stream)
    assert first == lines(3, 5)
    await later()
    rest = b"".join([chunk async for chunk in stream])
    assert first + rest == lines(3, 40)


async def test_an_agent_that_forgot_how_far_it_shipped_ships_again_and_readers_see_each_byte_once(
    tmp_path: Path, s3_root: str
) -> None:
    layout = ArtifactLayout(f"{s3_root}/again")
    rank = a_rank(tmp_path)
    rank.log_path.write_bytes(lines(0, 30))
    await LogShipper(layout, FakeClock(), segment_max=100).ship(rank, final=True)
    with rank.log_path.open("ab") as f:
        f.write(lines(30, 45))
    restarted = rp.RankProcess.from_persisted({**rank.persisted("boot"), "logShipped": 0})  # an older table
    await LogShipper(layout, FakeClock(), segment_max=150).ship(restarted, final=True)
    job, attempt = job_and_attempt()
    assert await RankLogs(layout).tail(job, attempt, 1, 100_000) == lines(0, 45)
    kept = rp.RankProcess.from_persisted(rank.persisted("boot"))
    assert kept.log_shipped == len(lines(0, 30))  # the rank table keeps the offset


async def test_a_failed_upload_keeps_the_offset_for_the_next_round(tmp_path: Path, s3_root: str) -> None:
    bucketless = ArtifactLayout("s3://no-such-bucket-here/prefix")
    rank = a_rank(tmp_path)
    rank.log_path.write_bytes(lines(0, 5))
    await LogShipper(bucketless, FakeClock()).ship(rank, final=True)  # logged, not raised
    assert rank.log_shipped == 0
    layout = ArtifactLayout(f"{s3_root}/retry")
    await LogShipper(layout, FakeClock()).ship(rank, final=True)
    assert rank.log_shipped == len(lines(0, 5))
    assert [c.name for c in list_children(layout.rank_log_segments("acme", "job-1", 2, 1))] == [segment_name(0)]
