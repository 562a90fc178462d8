"""A rank's log as immutable segments in an object store: names, and assembly with overlaps and gaps."""

from __future__ import annotations

import pytest

from trainyard_contract.logsegments import Piece, pieces, segment_name, segment_offset, size


def test_a_segment_is_named_by_its_offset_and_read_back() -> None:
    assert segment_name(0) == "0000000000000000.log"
    assert segment_offset(segment_name(123_456)) == 123_456
    assert segment_offset("rank-0.log") is None and segment_offset("0000000000000001.log.tmp") is None
    with pytest.raises(ValueError):
        segment_name(-1)


@pytest.mark.parametrize(("listing", "expected"), [
    ([], []),
    ([(segment_name(0), 10), (segment_name(10), 5)],
     [Piece(segment_name(0), 0, 0, 10), Piece(segment_name(10), 10, 0, 5)]),
    # listed in any order
    ([(segment_name(10), 5), (segment_name(0), 10)],
     [Piece(segment_name(0), 0, 0, 10), Piece(segment_name(10), 10, 0, 5)]),
    # a restarted agent shipped again from 0: the second segment adds only what is new
    ([(segment_name(0), 10), (segment_name(4), 16)],
     [Piece(segment_name(0), 0, 0, 10), Piece(segment_name(4), 10, 6, 10)]),
    # a segment inside what is covered adds nothing
    ([(segment_name(0), 10), (segment_name(2), 3)], [Piece(segment_name(0), 0, 0, 10)]),
    # a gap is skipped over; other names and empty objects are ignored
    ([(segment_name(0), 4), (segment_name(8), 2), ("notes.txt", 9), (segment_name(4), 0)],
     [Piece(segment_name(0), 0, 0, 4), Piece(segment_name(8), 8, 0, 2)]),
])
def test_pieces_take_each_byte_once(listing: list[tuple[str, int]], expected: list[Piece]) -> None:
    assert pieces(listing) == expected
    assert size(listing) == (expected[-1].end if expected else 0)
