import signal

from trainyard_contract.exitcodes import NAN, OK, exit_reason


def test_exit_reasons() -> None:
    assert exit_reason(OK) == "ok"
    assert exit_reason(NAN) == "nan"
    assert exit_reason(77) == "error"
    assert exit_reason(-signal.SIGKILL) == "killed"
    assert exit_reason(-signal.SIGSEGV) == "signal-11"
