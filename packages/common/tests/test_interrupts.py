"""A Ctrl-C that a library swallows while the launcher checks still stops the launch."""

import os
import signal

import pytest
from qwen3_titan_common.launcher import interrupts


@pytest.fixture
def default_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a caller that ignores it: stays ignored
    interrupts._seen.clear()
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
    interrupts._seen.clear()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_swallowed_signal_is_remembered(default_handlers, signum):
    interrupts.notice_interrupts()
    interrupts.raise_if_interrupted()  # nothing yet
    try:
        os.kill(os.getpid(), signum)
    except BaseException:  # noqa: BLE001 (what a library's bare except does)
        pass
    with pytest.raises(KeyboardInterrupt):
        interrupts.raise_if_interrupted()


def test_an_ignored_signal_stays_ignored(default_handlers):
    interrupts.notice_interrupts()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
