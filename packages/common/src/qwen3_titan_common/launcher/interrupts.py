"""Ctrl-C (or SIGTERM, SIGHUP) before torchrun starts: noticed even where other code swallows it.

Python raises ``KeyboardInterrupt`` wherever the main thread is; inside a library's ``try: ... except:``
(torch's import, on a machine where the launcher needs it to count devices) it is swallowed and the
launch would go on. So the handler also remembers the signal, and the launcher asks
(:func:`raise_if_interrupted`) before it starts torchrun; from then on ``launcher.supervise`` handles signals.
Signals the caller ignores (a background job's SIGINT) stay ignored.
"""

from __future__ import annotations

import signal
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_seen = threading.Event()


def _handle(signum, frame) -> None:
    _seen.set()
    raise KeyboardInterrupt


def notice_interrupts() -> None:
    """Install the remembering handler where the default one is in place (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in _SIGNALS:
        if signal.getsignal(signum) in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(signum, _handle)


def interrupted() -> bool:
    """Whether a signal arrived since :func:`notice_interrupts`, swallowed or not."""
    return _seen.is_set()


def raise_if_interrupted() -> None:
    """``KeyboardInterrupt`` if a signal arrived since :func:`notice_interrupts`, swallowed or not."""
    if _seen.is_set():
        raise KeyboardInterrupt
