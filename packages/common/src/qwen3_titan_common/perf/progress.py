"""Progress of a phase that runs long: loading weights, indexing a large data file, exporting.

Silent for the first 5 seconds (most phases end sooner; ``--metrics.progress_seconds`` sets it); then one
line every 5 seconds, with the fraction
done, the rate and the time left where the amount of work is known, or the time spent where it is not
(a heartbeat from a background thread); and, once past 5 s, one line when the phase ends.

    with Phase("export to outputs/run/hf/step-30", total=8_000_000_000, unit="B") as phase:
        for tensor in tensors:
            ...
            phase.advance(tensor.nbytes)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

QUIET_SECONDS = 5.0
EVERY_SECONDS = 5.0
# The run's cadence (--metrics.progress_seconds), set once by the trainer from its config.
_cadence = {"quiet": QUIET_SECONDS, "every": EVERY_SECONDS}


def set_cadence(seconds: float) -> None:
    """Phases print once past ``seconds``, then every ``seconds`` (at least one second apart)."""
    _cadence.update(quiet=seconds, every=max(seconds, 1.0))


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_amount(amount: float, unit: str) -> str:
    if unit == "B":
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if amount >= scale:
                return f"{amount / scale:.2f} {name}"
        return f"{amount:.0f} B"
    return f"{amount:,.0f}{' ' + unit if unit else ''}"


class Phase:
    def __init__(
        self,
        what: str,
        total: float | None = None,
        unit: str = "",
        *,
        log: Callable[[str], None] | None = None,
        quiet_seconds: float | None = None,
        every_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.log = log or logger.info
        self.quiet_seconds = _cadence["quiet"] if quiet_seconds is None else quiet_seconds
        self.every_seconds = _cadence["every"] if every_seconds is None else every_seconds
        self.clock = clock
        self.done = 0.0
        self.start = self.clock()
        self._next_line = self.start + self.quiet_seconds
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def __enter__(self) -> Phase:
        self.start = self.clock()
        self._next_line = self.start + self.quiet_seconds
        if self.total is None:
            self._heartbeat = threading.Thread(target=self._beat, name=f"progress: {self.what}", daemon=True)
            self._heartbeat.start()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        elapsed = self.clock() - self.start
        if kind is None and elapsed >= self.quiet_seconds:
            self.log(f"[progress] {self.what}: done in {format_duration(elapsed)}")

    def advance(self, amount: float = 1) -> None:
        with self._lock:
            self.done += amount
            now = self.clock()
            if now < self._next_line:
                return
            self._next_line = now + self.every_seconds
        self.log(self.line(now))

    def line(self, now: float) -> str:
        elapsed = now - self.start
        if self.total is None or self.total <= 0:
            return f"[progress] {self.what}: {format_duration(elapsed)} so far"
        fraction = min(self.done / self.total, 1.0)
        text = (
            f"[progress] {self.what}: {format_amount(self.done, self.unit)} of "
            f"{format_amount(self.total, self.unit)} ({100 * fraction:.0f}%), {format_duration(elapsed)}"
        )
        if 0 < fraction < 1:
            text += f", about {format_duration(elapsed * (1 - fraction) / fraction)} left"
        return text

    def _beat(self) -> None:
        while not self._stop.wait(max(0.0, self._next_line - self.clock())):
            now = self.clock()
            self._next_line = now + self.every_seconds
            self.log(self.line(now))
