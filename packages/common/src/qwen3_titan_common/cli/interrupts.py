"""Ctrl-C (or SIGTERM, SIGHUP) before any rank starts: noticed even where other code swallows it.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT arrives. While
the launcher imports torch and torchtitan and parses the run's config, that is sometimes inside a
``try: ... except:`` of a library, which swallows it: the launch then went on and trained as if nothing
had happened (seen here about one time in five with Ctrl-C one second after ``train``). So the handler
installed here also remembers the signal, and the launcher asks (:func:`raise_if_interrupted`) once its
checks are done, before it lets the ranks go. SIGTERM and SIGHUP take the same path, so that torchrun,
started early in a session of its own, is stopped with the launcher instead of outliving it. Signals
that the caller ignores (a background job's SIGINT) stay ignored; once the ranks run, the supervisor's
own handler (``cli.supervise``) takes over.
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
