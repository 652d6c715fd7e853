"""Ctrl-C (or SIGTERM, SIGHUP) to the launcher: before torchrun starts, noticed even where other code
swallows it; once it runs, forwarded to it (:class:`ForwardedInterruption`).

Python raises ``KeyboardInterrupt`` wherever the main thread is; inside a library's ``try: ... except:``
(torch's import, on a machine where the launcher needs it to count devices) it is swallowed and the
launch would go on. So the handler also remembers the signal, and the launcher asks
(:func:`raise_if_interrupted`) before it starts torchrun.
Signals the caller ignores (a background job's SIGINT) stay ignored.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

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


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone already


class ForwardedInterruption:
    """Once torchrun runs: forwards the first SIGINT/SIGTERM/SIGHUP to it (it stops its ranks) and remembers it.

    Installed before torchrun starts. torchrun that has started no rank yet is killed instead: it may be
    importing torch, which can swallow the signal, and there is nothing of it to stop gracefully. Ranks that
    torchrun has not stopped ``grace_s`` seconds later are killed, so no process outlives the run.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.proc: subprocess.Popen | None = None
        self.signum: int | None = None
        self.ranks: list[int] = []
        self._previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}

    def attach(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        if self.signum is not None:
            proc.kill()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            return  # torchrun is already stopping its ranks; a second signal would cut that short
        self.signum = signum
        if self.proc is None:
            return
        self.ranks = descendants(self.proc.pid)
        if self.proc.poll() is None:
            if self.ranks:
                self.proc.send_signal(signum)
            else:
                self.proc.kill()
        timer = threading.Timer(self.grace_s, self._force)
        timer.daemon = True
        timer.start()

    def _force(self) -> None:
        assert self.proc is not None
        kill_all([*self.ranks, *descendants(self.proc.pid), self.proc.pid])

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
