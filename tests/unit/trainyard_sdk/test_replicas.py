"""The pure parts of fault-tolerant replicas (trainyard.replicas): which micro-batches a replica reads, how its
steps are counted, how torchft reads its index, and what exit a replica with nothing to heal from leaves with."""

from __future__ import annotations

import pytest

from trainyard.exits import NothingToHeal, exit_code_for
from trainyard.replicas import ReplicaCounts, micro_batch_share, replica_id
from trainyard_contract import exitcodes


def test_accumulate_shares_every_micro_batch_once_among_the_replicas_that_step() -> None:
    for participants in (1, 2, 3, 4, 6):
        shares = [micro_batch_share(6, participants, p) for p in range(participants)]
        assert sorted(i for share in shares for i in share) == list(range(6))
    assert micro_batch_share(6, 2, 1) == [1, 3, 5]
    assert micro_batch_share(6, 4, 3) == [3]  # fewer than the others: its loss weight is the same per batch
    with pytest.raises(ValueError, match="participating rank 2 of 2"):
        micro_batch_share(6, 2, 2)


def test_degraded_steps_are_counted_and_the_first_ones_kept() -> None:
    counts = ReplicaCounts()
    for step in range(1, 1201):
        counts.note(step, participants=2 if step % 2 else 3, replicas=3)
    assert counts.committed == 1200 and counts.degraded_total == 600
    assert len(counts.degraded) == 600 and counts.degraded[:2] == [1, 3]


def test_torchft_reads_the_replica_index_from_the_ids_trailing_digits() -> None:
    from torchft.manager import extract_trailing_digits

    assert extract_trailing_digits(replica_id("job-2f00ab12", 3)) == 3
    assert extract_trailing_digits(replica_id("job-000007", 12)) == 12  # a job id ending in digits does not count


def test_a_replica_with_nothing_to_heal_from_leaves_with_exit_0() -> None:
    assert exit_code_for(NothingToHeal("alone")) == exitcodes.OK
