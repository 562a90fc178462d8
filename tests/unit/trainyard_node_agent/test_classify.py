"""Why a rank ended: the classification table, and the parsers behind it."""

from __future__ import annotations

import pytest

from trainyard_node_agent.classify import ExitFacts, classify_exit, last_error_line, parse_oom_kills

NCCL_LOG = """step 12/40 loss 3.1
[rank1]:[E ProcessGroupNCCL.cpp:1595] NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled system error
RuntimeError: NCCL communicator was aborted
"""
CUDA_OOM_LOG = "RuntimeError: CUDA error: out of memory\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
TIMEOUT_LOG = ("[E ProcessGroupNCCL.cpp:607] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
               "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n")
GLOO_PEER_LOG = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"


@pytest.mark.parametrize(("facts", "reason", "detail_has"), [
    (ExitFacts(0), "ok", None),
    (ExitFacts(3, "trainyard_common.errors.NonFiniteError: loss is nan at step 7"), "nan", "nan at step 7"),
    (ExitFacts(6), "oom", None),
    (ExitFacts(2), "config", None),
    (ExitFacts(4), "checkpoint", None),
    (ExitFacts(5), "data", None),
    (ExitFacts(7, "RuntimeError: ignored"), "preempted", "checkpointed on request"),  # exit 7: not a failure
    (ExitFacts(1, NCCL_LOG), "nccl", "NCCL error"),
    (ExitFacts(-6, NCCL_LOG), "nccl", "NCCL error"),  # an abort after an NCCL error
    (ExitFacts(1, CUDA_OOM_LOG), "oom", "CUDA out of memory"),  # OOM wins over "CUDA error"
    (ExitFacts(1, TIMEOUT_LOG), "hang", "collective operation timeout"),  # a process-group timeout
    (ExitFacts(1, GLOO_PEER_LOG), "error", "Connection closed by peer"),  # a peer died: an ordinary error
    (ExitFacts(-9), "killed", None),
    (ExitFacts(-9, oom_kills=1), "oom", "OOM killer"),  # SIGKILL while the cgroup counted an OOM kill
    (ExitFacts(-11), "signal-11", None),
    (ExitFacts(-15, revoked="attempt failed: error"), "revoked", "attempt failed"),
    (ExitFacts(-15, revoked="preempted by job hi-prio"), "preempted", "preempted"),
    (ExitFacts(-9, hang="no step progress for 31s"), "hang", "31s"),
    (ExitFacts(-9, lost="no exit status was recorded"), "lost", "no exit status"),
    (ExitFacts(-9, NCCL_LOG, revoked="paused"), "revoked", "paused"),  # our own decision comes first
])
def test_classification(facts: ExitFacts, reason: str, detail_has: str | None) -> None:
    got, detail = classify_exit(facts)
    assert got == reason
    if detail_has is None:
        assert detail is None or reason in ("killed", "signal-11")
    else:
        assert detail is not None and detail_has in detail


def test_detail_is_the_last_exception_line_and_is_trimmed() -> None:
    log = "Traceback (most recent call last):\n  File x\nValueError: first\nKeyError: 'second'\nbye\n"
    assert last_error_line(log) == "KeyError: 'second'"
    _, detail = classify_exit(ExitFacts(1, "RuntimeError: NCCL error " + "x" * 1000))
    assert detail is not None and len(detail) <= 300 and detail.endswith("…")


def test_oom_kill_counters_of_cgroup_v1_and_v2() -> None:
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n") == 4  # v1 memory.oom_control
    assert parse_oom_kills("low 0\nhigh 0\nmax 2\noom 3\noom_kill 2\n") == 2  # v2 memory.events
    assert parse_oom_kills("nothing here") is None
