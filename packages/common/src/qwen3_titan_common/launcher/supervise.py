"""Runs torchrun, streams its output, keeps all of it in the run's log, and ends it in one line.

The launcher checks nothing a rank checks: each rank runs every check before it writes anything
(``Qwen3Trainer.resolved_and_checked``). A failed run shows what happened before it failed, then one ``train:``
line: a rank's input error, an interruption (the step reached, the newest complete checkpoint), or an internal
error with where the full log is. The line comes from torchelastic's error file, which torchrun fills
from the first rank to fail (``launcher.rank_errors``), else from the failing rank's output.

A stopping rank prints one ``[stopped]`` line before the rest of its failure, on the same stream: that
line, everything after it and torchrun's failure report stay in the log only, whatever order the
processes' output arrives in (``--show-traceback`` shows them). A traceback nobody announced (a
library's) is held until a later step shows that training went on. The log and the ranks' own output
(torchrun's ``--log-dir``) start in a temporary folder, and move to ``<dump_folder>/logs/`` once rank 0
says, its checks passed, where that is (``run.json``).

Exit codes: 0 done, 2 input error, 1 internal error, 130 interrupted (SIGINT, SIGTERM or SIGHUP).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TextIO

from qwen3_titan_common.launcher.rank_errors import (
    RESTARTED,
    RUN_FILE,
    SHOW_TRACEBACK_ENV,
    STOPPED,
    USER_ERROR,
    parser_message,
)
from qwen3_titan_common.launcher.summary import SUMMARY_FILE, RunSummary

EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 2, 1, 130
# How long torchrun gets to stop its ranks after an interruption before they are killed.
STOP_GRACE_S = 60.0
LOG_DIR = "logs"
ROOT_CAUSE_FILE = "root_cause.json"  # torchrun's own TORCHELASTIC_ERROR_FILE: the first failure's


def torchrun_executable() -> str:
    beside_python = Path(sys.executable).with_name("torchrun")
    return str(beside_python) if beside_python.exists() else "torchrun"


# A rank that dies of one of our input errors outside the trainer (a config function) prints
# `qwen3_titan_...XxxError: message` at the end of its traceback.
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

    A rank that dies of one of our input errors outside the trainer ends its traceback with
    ``qwen3_titan_...XxxError: message``; torchtitan's parser's message is read from the rank's own
    output at the end (``launcher.rank_errors.parser_message``).
    """

    def __init__(self) -> None:
        self.message: str | None = None
        self.last_exception: str | None = None
        self.last_step: int | None = None
        self.cause_rank: int | None = None
        self.cause_local_rank: int | None = None
        self.cause_exitcode: int | None = None
        self._in_root_cause = False

    def feed(self, line: str) -> None:
        text = _RANK_PREFIX.sub("", line.rstrip("\n"))
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
    """The user-facing error in some output (a rank's), or None."""
    summary = ErrorSummary()
    for line in lines:
        summary.feed(line)
    return summary.message


class _Console:
    """Shows lines live, except what a failure prints (module docstring), which only the log gets.

    Until the run's rank says where its dump folder is, the log is kept in memory: nothing is written
    there before the rank's checks passed.
    """

    def __init__(self, show_all: bool):
        self.show_all = show_all
        self.log: TextIO | None = None
        self.pending: list[str] | None = []  # the log's lines before it has a file
        self.stopped = False  # a rank said it stops, or torchrun reported a failure: hold to the end
        self.holding = False  # a traceback nobody announced: held until training goes on
        self.held: list[str] = []
        self.last_step = 0  # the newest step line shown

    def open_log(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.log = open(path, "a", buffering=1)  # noqa: SIM115 (closed by close())
            self.log.writelines(self.pending or [])
        except OSError:  # its disk is full: the run goes on, and its last line says why it stopped
            self.log = None
        self.pending = None

    def close(self, fallback: Path | None = None) -> Path | None:
        """Close the log; a log still in memory goes to ``fallback``. Where it is, or None."""
        if self.pending is not None and fallback is not None:
            self.open_log(fallback)
            where = fallback if self.log is not None else None
        else:
            where = Path(self.log.name) if self.log is not None else None
        if self.log is not None:
            try:
                self.log.close()
            except OSError:
                pass
        return where

    def line(self, line: str) -> None:
        if self.pending is not None:
            self.pending.append(line)
        elif self.log is not None:
            try:
                self.log.write(line)
            except OSError:
                self.log = None
        if self.show_all:
            self._show(line)
            return
        text = _RANK_PREFIX.sub("", line)
        if text.startswith(RESTARTED):  # torchrun restarted the ranks: the failure before is behind them
            self.stopped = False
            self.release()
        if text.startswith(STOPPED) or _TORCHRUN_FAILURE.match(text):
            self.stopped = True
        elif not self.holding and (_TRACEBACK_START.match(text) or "╭─" in text):
            self.holding = True
        step = _STEP_LINE.search(text)
        # Training went on: what was held was not a failure. The line of the step in progress can come
        # after a traceback (stdout and stderr interleave), so only a later step releases.
        if self.holding and not self.stopped and step and int(step.group(1)) > self.last_step + 1:
            self.release()
        if step and not (self.holding or self.stopped):
            self.last_step = int(step.group(1))
        if self.holding or self.stopped:
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
            pass  # gone already


class _Interruption:
    """Forwards the first SIGINT/SIGTERM/SIGHUP to torchrun (which stops its ranks) and remembers it.

    Installed before torchrun starts. torchrun that has started no rank yet is killed instead: it may
    be importing torch, which can swallow the signal, and there is nothing of it to stop gracefully.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, console: _Console):
        self.console = console
        self.proc: subprocess.Popen | None = None
        self.signum: int | None = None
        self.ranks: list[int] = []
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def attach(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        if self.signum is not None:
            proc.kill()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            return  # torchrun is already stopping its ranks; a second signal would cut that short
        self.signum = signum
        self.console.stopped = True
        if self.proc is None:
            return
        self.ranks = _descendants(self.proc.pid)
        if self.proc.poll() is None:
            if self.ranks:
                self.proc.send_signal(signum)
            else:
                self.proc.kill()
        # If torchrun does not stop its ranks in time, end them all (their output pipe closes with them).
        timer = threading.Timer(STOP_GRACE_S, self._force)
        timer.daemon = True
        timer.start()

    def _force(self) -> None:
        assert self.proc is not None
        _kill_leftovers([*self.ranks, *_descendants(self.proc.pid), self.proc.pid])

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class _RankFiles:
    """What torchrun and the ranks leave in torchrun's ``--log-dir``: per rank
    ``<run id>/attempt_<n>/<local rank>/`` with its output, torchelastic's ``error.json``, and from
    ``launcher.rank_errors`` ``run.json`` and (rank 0) the summary; torchrun's root cause beside them."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _newest(self, name: str) -> Path | None:
        found = sorted(self.folder.glob(f"*/attempt_*/*/{name}"), key=lambda p: p.stat().st_mtime)
        return found[-1] if found else None

    def run_folders(self) -> dict | None:
        path = self._newest(RUN_FILE)
        try:
            return json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):
            return None

    def summary(self) -> RunSummary | None:
        path = self._newest(SUMMARY_FILE)
        return RunSummary.read(path) if path is not None else None

    def root_cause(self) -> str | None:
        """The first failing rank's recorded message (torchrun's copy of its error file), or None. A rank's
        user error wins over another's internal one: its timestamp has whole seconds, a tie goes to rank 0."""
        messages = [_recorded(self.folder / ROOT_CAUSE_FILE)]
        errors = sorted(self.folder.glob("*/attempt_*/*/error.json"), key=lambda p: p.stat().st_mtime)
        messages += [_recorded(path) for path in errors]
        found = [m for m in messages if m is not None]
        return next((m for m in found if m.startswith(USER_ERROR)), found[0] if found else None)

    def output_error(self, local_rank: int | None, argv: list[str]) -> str | None:
        """The user error in a rank's own output: ranks other than 0 are not echoed to the terminal."""
        logs = sorted(self.folder.glob("*/attempt_*/*/stderr.log"), key=lambda p: p.stat().st_mtime)
        if local_rank is not None:
            logs = [p for p in logs if p.parent.name == str(local_rank)] + logs
        for path in logs:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            message = error_from_output(text.splitlines()) or parser_message(text, argv)
            if message is not None:
                return message
        return None


def _recorded(path: Path) -> str | None:
    try:
        message = json.loads(path.read_text()).get("message")
    except (OSError, ValueError, AttributeError):
        return None
    message = message.get("message") if isinstance(message, dict) else message
    return message if isinstance(message, str) else None


def _interrupted_line(summary: ErrorSummary, checkpoint_folder: Path | None) -> str:
    from qwen3_titan_common.hf.start import newest_complete_step

    where = f"at step {summary.last_step}" if summary.last_step is not None else "before the first step"
    newest = newest_complete_step(checkpoint_folder) if checkpoint_folder is not None else None
    if newest is None:
        return f"interrupted {where}; no complete checkpoint yet: rerunning the same command starts over"
    return (
        f"interrupted {where}; newest complete checkpoint: step {newest} ({checkpoint_folder}); "
        "rerun the same command to resume"
    )


def _failure_line(
    summary: ErrorSummary, log_path: Path | None, show_tracebacks: bool, returncode: int, recorded: str | None
) -> str:
    where = f"; the full log is in {log_path}" if log_path is not None else ""
    show = f" ({SHOW_TRACEBACK_ENV}=1 shows it here)" if not show_tracebacks else ""
    code = summary.cause_exitcode
    rank = f"rank {summary.cause_rank}" if summary.cause_rank is not None else "a rank"
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        oom = (
            " (out of memory? the system kills what exhausts host memory: lower --training.local_batch_size "
            "(--batch-size) or --training.seq_len (--seq-len); `train --dry-run` estimates the memory per rank)"
            if -code == signal.SIGKILL
            else ""
        )
        return f"{rank} was killed by {name}{oom}{where}{show}"
    exception = recorded or summary.last_exception
    if exception is not None:
        return f"internal error in {rank}: {(exception.splitlines() or [''])[0]}{where}{show}"
    return f"torchrun exited with status {returncode}{where}{show}"


def run_torchrun(
    command: list[str],
    env: dict[str, str],
    *,
    shown_env: dict[str, str] | None = None,
    show_tracebacks: bool = False,
) -> tuple[int, RunSummary | None]:
    """Run ``command`` (torchrun) to the end: its exit code, ended by one line unless 0, and the summary
    rank 0 left (None when it left none: another node, or a run that did not finish)."""
    scratch = Path(tempfile.mkdtemp(prefix="qwen3-titan-run-"))
    rank_logs = scratch / "ranks"
    rank_logs.mkdir()
    at = command.index("-m")
    command = [*command[:at], "--log-dir", str(rank_logs), *command[at:]]
    show_all = show_tracebacks or bool(os.environ.get(SHOW_TRACEBACK_ENV))
    env = {**env, "TORCHELASTIC_ERROR_FILE": str(rank_logs / ROOT_CAUSE_FILE)}
    if show_all:
        env[SHOW_TRACEBACK_ENV] = "1"  # the ranks print their user errors' tracebacks too
    env_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in (shown_env or {}).items())
    print(f"[train] {env_line + ' ' if env_line else ''}{shlex.join(command)}", file=sys.stderr, flush=True)
    console = _Console(show_all)
    console.pending.append(f"[train] {shlex.join(command)}\n")
    interruption = _Interruption(console)
    try:
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
        interruption.attach(proc)
        summary, files = ErrorSummary(), _RankFiles(rank_logs)
        folders = _follow(proc, console, summary, files)
        return _finish(proc.wait(), interruption, console, summary, files, folders, scratch, command)
    finally:
        interruption.restore()


def _follow(
    proc: subprocess.Popen, console: _Console, summary: ErrorSummary, files: _RankFiles
) -> dict | None:
    """Show and log torchrun's output to its end; the log moves to the dump folder once rank 0 names it."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    folders, next_look = None, 0.0
    while True:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            line = ""
        if line is None:
            return folders
        if line:
            console.line(line)
            summary.feed(line)
        if folders is None and time.monotonic() >= next_look:
            next_look = time.monotonic() + 0.5
            if (folders := files.run_folders()) is not None:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                console.open_log(Path(folders["dump_folder"]) / LOG_DIR / f"train-{stamp}.log")


def _finish(returncode, interruption, console, summary, files, folders, scratch, command):
    sys.stdout.flush()
    folders = folders or files.run_folders()
    checkpoint_folder = Path(folders["checkpoint_folder"]) if folders else None
    run_summary = files.summary() if returncode == 0 else None
    if interruption.signum is not None:
        _kill_leftovers(interruption.ranks)
        log_path, code = console.close(), EXIT_INTERRUPTED
        if not interruption.ranks:
            line = "train: interrupted before any rank started; nothing was written"
        else:
            line = f"train: {_interrupted_line(summary, checkpoint_folder)}"
    elif returncode == 0:
        console.release()
        log_path, line, code = console.close(), None, 0
    else:
        recorded = files.root_cause()
        message = recorded[len(USER_ERROR) :] if recorded and recorded.startswith(USER_ERROR) else None
        if message is None and recorded is None:
            message = summary.message or files.output_error(summary.cause_local_rank, command)
        if message is not None:
            log_path, line, code = console.close(), f"train: {message}", EXIT_INPUT
        else:
            log_path = console.close(fallback=scratch / "train.log")
            line = f"train: {_failure_line(summary, log_path, console.show_all, returncode, recorded)}"
            code = EXIT_INTERNAL
    kept = folders is None or _keep(files.folder, Path(folders["dump_folder"]) / LOG_DIR / "ranks")
    if kept and (log_path is None or not log_path.is_relative_to(scratch)):
        shutil.rmtree(scratch, ignore_errors=True)
    if line is not None:
        print(line, file=sys.stderr)
    return code, run_summary


def _keep(source: Path, destination: Path) -> bool:
    try:
        shutil.copytree(source, destination, dirs_exist_ok=True)
    except OSError:
        return False  # a full disk: the temporary copy stays, and the run's own log says what happened
    return True
