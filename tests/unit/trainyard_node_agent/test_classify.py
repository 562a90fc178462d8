"""Why a rank ended: the classification table, and the parsers behind it."""

from __future__ import annotations

import pytest

from trainyard_node_agent.classify import ExitFacts, classify_exit, last_error_line, parse_oom_kills

NCCL_LOG = """step 12/40 loss 3.1
[rank1]:[E ProcessGroupNCCL.cpp:1595] NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled system error
RuntimeError: NCCL communicator was aborted
"""  # noqa: E501 - a log as torch writes it
CUDA_OOM_LOG = ("RuntimeError: CUDA error: out of memory\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
TIMEOUT_LOG = ("[E ProcessGroupNCCL.cpp:607] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
               "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n")
GLOO_PEER_LOG = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"


@pytest.mark.parametrize(("facts", "reason", "detail_has"), [
    (ExitFacts(0), "ok", None),
    (ExitFacts(3, "trainyard_contract.errors.NonFiniteError: loss is nan at step 7"), "nan", "nan at step 7"),
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
    # the sandbox could not be set up: this node's trouble (retried) — unless a path was swapped for a link
    (ExitFacts(125, "sandbox: cannot set up the rank's sandbox: [Errno 1] mount: Operation not permitted"),
     "error", "cannot set up"),
    (ExitFacts(125, "sandbox: cannot set up the rank's sandbox: [Errno 40] /a/step: 'step' is a symbolic link "
                    "(a rank's path is never followed): refused"), "security", "never followed"),
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


# Real log tails of user scripts (python 3.11), as a rank's log holds them.
IMPORT_MISSING_LOG = """Traceback (most recent call last):
  File "/cache/code/1f2e/tree/train.py", line 1, in <module>
    import does_not_exist
ModuleNotFoundError: No module named 'does_not_exist'
"""
IMPORT_NAME_LOG = """Traceback (most recent call last):
  File "/cache/code/1f2e/tree/train.py", line 1, in <module>
    from os import nope
ImportError: cannot import name 'nope' from 'os' (/usr/lib/python3.11/os.py)
"""
SYNTAX_LOG = """  File "/cache/code/1f2e/tree/train.py", line 1
    def f(:
          ^
SyntaxError: invalid syntax
"""
TAB_LOG = """  File "/cache/code/1f2e/tree/train.py", line 3
    return 2
TabError: inconsistent use of tabs and spaces in indentation
"""
NO_FILE_LOG = ("/usr/local/bin/python3: can't open file '/cache/code/1f2e/tree/trian.py': "
               "[Errno 2] No such file or directory\n")
MID_RUN_LOG = """step 0
step 1
step 2
Traceback (most recent call last):
  File "/cache/code/1f2e/tree/train.py", line 4, in <module>
    raise ValueError("bad batch at step 3")
ValueError: bad batch at step 3
"""
# An import error that was handled, and a later failure: not a failure to start.
CHAINED_LOG = IMPORT_MISSING_LOG + "\nDuring handling of the above exception, another exception occurred:\n\n" \
    "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\nRuntimeError: no backend\n"


def user(code: int, tail: str = "", *, progressed: bool = False, start_error: str | None = None) -> ExitFacts:
    return ExitFacts(code, tail, user_code=True, progressed=progressed, start_error=start_error)


@pytest.mark.parametrize(("facts", "reason", "detail"), [
    (user(1, IMPORT_MISSING_LOG), "config", "ModuleNotFoundError: No module named 'does_not_exist'"),
    (user(1, IMPORT_NAME_LOG), "config",
     "ImportError: cannot import name 'nope' from 'os' (/usr/lib/python3.11/os.py)"),
    (user(1, SYNTAX_LOG), "config", "SyntaxError: invalid syntax"),
    (user(1, TAB_LOG), "config", "TabError: inconsistent use of tabs and spaces in indentation"),
    (user(2, NO_FILE_LOG), "config", NO_FILE_LOG.strip()),
    # after progress (it wrote to its spool), the same failure is an ordinary, retried error
    (user(1, IMPORT_MISSING_LOG, progressed=True), "error", "ModuleNotFoundError: No module named 'does_not_exist'"),
    (user(1, MID_RUN_LOG), "error", "ValueError: bad batch at step 3"),
    (user(1, MID_RUN_LOG, progressed=True), "error", "ValueError: bad batch at step 3"),
    (user(1, CHAINED_LOG), "error", "RuntimeError: no backend"),
    (user(-9, IMPORT_MISSING_LOG), "killed", "ModuleNotFoundError: No module named 'does_not_exist'"),  # a signal
    (user(0, IMPORT_MISSING_LOG), "ok", None),
    (user(127, "launcher: cannot start ./run.sh: [Errno 2] No such file or directory: './run.sh'",
          start_error="[Errno 2] No such file or directory: './run.sh'"),
     "config", "entrypoint not found: [Errno 2] No such file or directory: './run.sh'"),
    (user(127, start_error="[Errno 13] Permission denied: './run.sh'"),
     "config", "entrypoint cannot be started: [Errno 13] Permission denied: './run.sh'"),
    # the built-in trainer: a failure to start is the node's (retried elsewhere), not the job's
    (ExitFacts(1, IMPORT_MISSING_LOG), "error", "ModuleNotFoundError: No module named 'does_not_exist'"),
    (ExitFacts(127, start_error="[Errno 2] No such file or directory: 'python9'"),
     "error", "cannot start the rank command: [Errno 2] No such file or directory: 'python9'"),
    # the agent's own decisions still come first
    (ExitFacts(-15, IMPORT_MISSING_LOG, revoked="paused", user_code=True), "revoked", "paused"),
])
def test_user_code_that_fails_to_start_is_a_config_error(facts: ExitFacts, reason: str, detail: str | None) -> None:
    assert classify_exit(facts) == (reason, detail)
