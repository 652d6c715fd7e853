"""Runs torchrun, streams its output, keeps all of it in the run's log, and ends every failure in one line.

torchrun is started before the launcher's checks end, its ranks held at the launch gate
(``runtime.launch_gate``); :class:`SupervisedRun` either lets them go and follows the run, or stops
them, having written nothing, when a check failed.

What the user sees of a failed run is what happened before it failed, then one ``train:`` line: a
rank's input error (our ``...Error: message``, or torchtitan's parser box), an interruption (with the
step reached and the newest complete checkpoint), or an internal error with where the full log is.
A rank's traceback and torchrun's failure report are held back from the terminal from the first line
of them; they stay in the log file (``QWEN3_TITAN_SHOW_TRACEBACK=1`` or ``--show-traceback`` shows
them live). Held lines are shown after all if training goes on (a step line follows) or succeeds.

Exit codes: 0 done, 2 input error, 1 internal error, 130 interrupted (SIGINT, SIGTERM or SIGHUP).
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from qwen3_titan_common.runtime.error_channel import ErrorChannel
from qwen3_titan_common.runtime.launch_gate import LaunchGate

SHOW_TRACEBACK_ENV = "QWEN3_TITAN_SHOW_TRACEBACK"
EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 2, 1, 130
# How long torchrun gets to stop its ranks after an interruption before they are killed.
STOP_GRACE_S = 60.0


def torchrun_executable() -> str:
    beside_python = Path(sys.executable).with_name("torchrun")
    return str(beside_python) if beside_python.exists() else "torchrun"


# A rank that dies of one of our input errors prints `qwen3_titan_...XxxError: message`
# at the end of its traceback (only our modules' classes are module-qualified there).
_USER_ERROR_LINE = re.compile(r"(?:^|[\s:])(?:qwen3_titan_[\w.]*|neuron_qwen3[\w.]*)\.(\w*Error): (.+)$")
_RANK_PREFIX = re.compile(r"^(?:\[(?:rank|default)\d+\]: ?)+")
_TRACEBACK_START = re.compile(r"^Traceback \(most recent call last\):")
# torchrun's own report of a failure (glog-style lines from torch.distributed.elastic).
_TORCHRUN_FAILURE = re.compile(r"^[EW]\d{4} .*torch/distributed/elastic/.*(failed|closing signal|signal)")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)): ?(.*)$")
_STEP_LINE = re.compile(r"step:\s*(\d+)(?:/\d+)?\s+.*loss:")  # "step: 3" or "step: 3/30"
_ROOT_CAUSE = re.compile(r"^\s*Root Cause")
_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class ErrorSummary:
    """Reads a run's output and keeps what its last line needs.

    A user error comes in two shapes: a rank that dies of one of our input errors ends its traceback
    with ``qwen3_titan_...XxxError: message``; torchtitan's CLI parser (tyro) draws a box
    (``╭─ ... │ message │ ... ╰─``) whose text, up to its ``───`` rule, is the message.
    """

    def __init__(self) -> None:
        self.message: str | None = None
        self.last_exception: str | None = None
        self.last_step: int | None = None
        self.cause_rank: int | None = None
        self.cause_local_rank: int | None = None
        self.cause_exitcode: int | None = None
        self._box: list[str] | None = None
        self._in_root_cause = False

    def feed(self, line: str) -> None:
        text = _RANK_PREFIX.sub("", line.rstrip("\n"))
        if "╭─" in text:
            self._box = []
            return
        if self._box is not None:
            inner = text.strip().strip("│").strip()
            if "╰" in text or inner.startswith("───"):
                if self._box:
                    self.message = " ".join(self._box)
                self._box = None
                return
            if inner:
                self._box.append(inner)
            return
        if step := _STEP_LINE.search(text):
            self.last_step = int(step.group(1))
        if match := _USER_ERROR_LINE.search(text):
            self.message = match.group(2)
        elif (match := _EXCEPTION_LINE.match(text)) and "ChildFailedError" not in text:
            self.last_exception = text.strip()
        self._root_cause(text)

    def _root_cause(self, text: str) -> None:
        if _ROOT_CAUSE.match(text):
            self._in_root_cause = True
        elif self._in_root_cause and (match := _CAUSE_RANK.match(text)):
            self.cause_rank, self.cause_local_rank = int(match.group(1)), int(match.group(2))
        elif self._in_root_cause and (match := _CAUSE_EXIT.match(text)):
            self.cause_exitcode = int(match.group(1))
            self._in_root_cause = False


def error_from_output(lines: Iterable[str]) -> str | None:
    """The user-facing error in some output (a rank's, or torchtitan's parser's), or None."""
    summary = ErrorSummary()
    for line in lines:
        summary.feed(line)
    return summary.message


@dataclass(frozen=True)
class RunContext:
    """Where a supervised run keeps its logs and checkpoints (from the run's parsed config)."""

    log_path: Path  # the whole output of the run, as the terminal would have shown it
    rank_log_dir: Path  # torchrun --log-dir: each local rank's own stdout/stderr
    checkpoint_folder: Path
    show_tracebacks: bool = False


class _Console:
    """Shows lines live, except a failure's traceback and torchrun's report, which only the log gets."""

    def __init__(self, log: TextIO | None, show_all: bool):
        self.log, self.show_all = log, show_all
        self.holding = False
        self.held: list[str] = []
        self.last_step = 0  # the newest step line shown

    def hold(self) -> None:
        self.holding = True

    def line(self, line: str) -> None:
        if self.log is not None:
            try:
                self.log.write(line)
            except OSError:  # its disk is full: the run goes on, and its last line says why it stopped
                self.log = None
        if self.show_all:
            self._show(line)
            return
        text = _RANK_PREFIX.sub("", line)
        if not self.holding and (
            _TRACEBACK_START.match(text) or _TORCHRUN_FAILURE.match(text) or "╭─" in text
        ):
            self.holding = True
        step = _STEP_LINE.search(text)
        # Training went on: what was held was not a failure. The line of the step in progress can come
        # after a failure's traceback (stdout and stderr interleave), so only a later step releases.
        if self.holding and step and int(step.group(1)) > self.last_step + 1:
            self.release()
        if step and not self.holding:
            self.last_step = int(step.group(1))
        if self.holding:
            self.held.append(line)
        else:
            self._show(line)

    def release(self) -> None:
        for held in self.held:
            self._show(held)
        self.held, self.holding = [], False

    @staticmethod
    def _show(line: str) -> None:
        sys.stdout.write(line)
        sys.stdout.flush()  # keep the log live when it goes to a pipe or a file


def _descendants(pid: int) -> list[int]:
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


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Interruption:
    """Forwards the first SIGINT/SIGTERM/SIGHUP to torchrun (which stops its ranks) and remembers it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, proc: subprocess.Popen, console: _Console):
        self.proc, self.console = proc, console
        self.signum: int | None = None
        self.ranks: list[int] = []
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            return  # torchrun is already stopping its ranks; a second signal would cut that short
        self.signum = signum
        self.ranks = _descendants(self.proc.pid)
        self.console.hold()
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        # If torchrun does not stop its ranks in time, end them all (their output pipe closes with them).
        timer = threading.Timer(STOP_GRACE_S, self._force)
        timer.daemon = True
        timer.start()

    def _force(self) -> None:
        _kill_leftovers([*self.ranks, *_descendants(self.proc.pid), self.proc.pid])

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _rank_error(rank_log_dir: Path, local_rank: int | None) -> str | None:
    """The user error in a rank's own log: ranks other than 0 are not echoed to the terminal."""
    logs = sorted(rank_log_dir.glob("*/attempt_*/*/stderr.log"), key=lambda p: p.stat().st_mtime)
    if local_rank is not None:
        logs = [p for p in logs if p.parent.name == str(local_rank)] + logs
    for path in logs:
        try:
            message = error_from_output(path.read_text(errors="replace").splitlines())
        except OSError:
            continue
        if message is not None:
            return message
    return None


def _interrupted_line(summary: ErrorSummary, context: RunContext | None) -> str:
    from qwen3_titan_common.hf.start import newest_complete_step

    where = f"at step {summary.last_step}" if summary.last_step is not None else "before the first step"
    newest = newest_complete_step(context.checkpoint_folder) if context is not None else None
    if newest is None:
        return f"interrupted {where}; no complete checkpoint yet: rerunning the same command starts over"
    return (
        f"interrupted {where}; newest complete checkpoint: step {newest} ({context.checkpoint_folder}); "
        "rerun the same command to resume"
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _failure_line(summary: ErrorSummary, context: RunContext | None, returncode: int) -> str:
    where = f"; the full log is in {context.log_path}" if context is not None else ""
    show = (
        f" ({SHOW_TRACEBACK_ENV}=1 shows it here)"
        if context is not None and not context.show_tracebacks
        else ""
    )
    code = summary.cause_exitcode
    rank = f"rank {summary.cause_rank}" if summary.cause_rank is not None else "a rank"
    if code is not None and code < 0:
        name = _signal_name(-code)
        oom = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"{rank} was killed by {name}{oom}{where}{show}"
    if summary.last_exception is not None:
        return f"internal error in {rank}: {summary.last_exception}{where}{show}"
    return f"torchrun exited with status {returncode}{where}{show}"


class SupervisedRun:
    """torchrun, started early with its ranks held at the launch gate (``runtime.launch_gate``), then
    either let go and followed to the end (:meth:`follow`) or stopped before any rank wrote (:meth:`abort`).

    torchrun runs in a session of its own: a terminal's Ctrl-C reaches only the launcher, which forwards
    it once. Its output is read from the start, by a thread, so that nothing blocks while the launcher
    checks; the lines wait in a queue until :meth:`follow` shows and logs them.
    """

    def __init__(self, command: list[str], env: dict[str, str], *, gated: bool = True):
        self.command = command
        self.channel = ErrorChannel()
        self.gate = LaunchGate() if gated else None
        extra = {**self.channel.env(), **(self.gate.env() if self.gate else {})}
        self.proc = subprocess.Popen(
            command, env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, start_new_session=True,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def abort(self) -> None:
        """Stop torchrun and its ranks, which are still at the gate: nothing of theirs is shown or kept."""
        ranks = _descendants(self.proc.pid)
        if self.gate is not None:
            self.gate.close()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_leftovers([*ranks, *_descendants(self.proc.pid), self.proc.pid])
            self.proc.wait()
        _kill_leftovers([p for p in ranks if _alive(p)])
        self.channel.close()

    def follow(self, context: RunContext | None = None) -> int:
        """Let the ranks go, show and log the run, and end it with its exit code and, on failure, one line."""
        show_all = bool(os.environ.get(SHOW_TRACEBACK_ENV)) or (
            context is not None and context.show_tracebacks
        )
        log = None
        if context is not None:
            context.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(context.log_path, "a", buffering=1)  # noqa: SIM115 (closed below, after the run)
            log.write(f"[train] {shlex.join(self.command)}\n")
        console = _Console(log, show_all)
        summary = ErrorSummary()
        interruption = _Interruption(self.proc, console)
        if self.gate is not None:
            self.gate.open()
        try:
            while (line := self.lines.get()) is not None:
                console.line(line)
                summary.feed(line)
            returncode = self.proc.wait()
            reported = self.channel.messages()
        finally:
            interruption.restore()
            self.channel.close()
            if self.gate is not None:
                self.gate.shutdown()
            if log is not None:
                try:
                    log.close()
                except OSError:
                    pass
        sys.stdout.flush()
        if interruption.signum is not None:
            _kill_leftovers([p for p in interruption.ranks if _alive(p)])
            print(f"train: {_interrupted_line(summary, context)}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if returncode == 0:
            console.release()
            return 0
        # The first rank to report is the root cause; the others stopped because it did.
        message = reported[0][1] if reported else summary.message
        if message is None and context is not None:
            message = _rank_error(context.rank_log_dir, summary.cause_local_rank)
        if message is not None:
            print(f"train: {message}", file=sys.stderr)
            return EXIT_INPUT
        print(f"train: {_failure_line(summary, context, returncode)}", file=sys.stderr)
        return EXIT_INTERNAL


def run_and_summarise(command: list[str], env: dict[str, str], context: RunContext | None = None) -> int:
    """Run ``command`` (torchrun) to the end, ungated: the supervised run without early start."""
    return SupervisedRun(command, env, gated=False).follow(context)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
