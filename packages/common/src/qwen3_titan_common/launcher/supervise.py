"""Runs torchrun, shows the ranks' log live, keeps all of its output in the run's log, and ends it in one line.

The launcher checks nothing a rank checks: each rank runs every check before it writes anything
(``Qwen3Trainer.resolved_and_checked``). The streams say what is shown: the ranks' stdout (torchtitan's
logger: the start, progress and step lines) goes to the terminal and the log; stderr (tracebacks, warnings,
torchrun's own report) to the log only (``--show-traceback`` shows it too). After torchrun returns, the
launcher reads what the ranks left (``launcher.rank_files``) and says how the run ended in one ``train:`` line:
a rank's input error, an interruption (the step reached, the newest complete checkpoint), or an internal
error with where the full log is. The log and the ranks' own output (torchrun's ``--log-dir``) start in a
temporary folder, and move to ``<dump_folder>/logs/`` at the end once rank 0's checks had passed.

Exit codes: 0 done, 2 input error, 1 internal error, 130 interrupted (SIGINT, SIGTERM or SIGHUP).
"""

from __future__ import annotations

import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from qwen3_titan_common.launcher.interrupts import ForwardedInterruption, kill_all
from qwen3_titan_common.launcher.rank_files import ROOT_CAUSE_FILE, RankFiles, TorchrunReport
from qwen3_titan_common.protocols.rank_errors import SHOW_TRACEBACK_ENV, USER_ERROR, show_tracebacks_asked
from qwen3_titan_common.protocols.summary import RunRecord, RunSummary

EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 2, 1, 130
# How long torchrun gets to stop its ranks after an interruption before they are killed.
STOP_GRACE_S = 60.0
LOG_DIR = "logs"


def torchrun_executable() -> str:
    beside_python = Path(sys.executable).with_name("torchrun")
    return str(beside_python) if beside_python.exists() else "torchrun"


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
    show_all = show_tracebacks or show_tracebacks_asked()
    env = {**env, "TORCHELASTIC_ERROR_FILE": str(rank_logs / ROOT_CAUSE_FILE)}
    # The ranks print their user errors' tracebacks too, or not: one spelling for them whatever the user's.
    env[SHOW_TRACEBACK_ENV] = "1" if show_all else "0"
    env_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in (shown_env or {}).items())
    print(f"[train] {env_line + ' ' if env_line else ''}{shlex.join(command)}", file=sys.stderr, flush=True)
    log = open(scratch / "train.log", "w", buffering=1)  # noqa: SIM115 (closed by _finish)
    log.write(f"[train] {shlex.join(command)}\n")
    interruption = ForwardedInterruption(STOP_GRACE_S)
    try:
        proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True,
        )  # fmt: skip
        interruption.attach(proc)
        report = TorchrunReport()
        _follow(proc, log, show_all, report)
        return _finish(proc.wait(), interruption, log, report, RankFiles(rank_logs), scratch, show_all)
    finally:
        interruption.restore()


def _follow(proc: subprocess.Popen, log, show_all: bool, report: TorchrunReport) -> None:
    """Every line of torchrun's two streams into the log, in the order they arrive; stdout's shown too."""
    lines: queue.Queue[tuple[bool, str] | None] = queue.Queue()

    def read(stream, is_stdout: bool) -> None:
        for line in stream:
            lines.put((is_stdout, line))
        lines.put(None)

    for stream, is_stdout in ((proc.stdout, True), (proc.stderr, False)):
        threading.Thread(target=read, args=(stream, is_stdout), daemon=True).start()
    open_streams = 2
    while open_streams:
        try:  # a timeout, so that the main thread runs the signal handlers while it waits
            item = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if item is None:
            open_streams -= 1
            continue
        is_stdout, line = item
        _write(log, line)
        if not is_stdout:
            report.feed(line)
        if is_stdout or show_all:
            sys.stdout.write(line)
            sys.stdout.flush()  # keep the output live when it goes to a pipe or a file


def _write(log, line: str) -> None:
    try:
        log.write(line)
    except (OSError, ValueError):
        pass  # its disk is full: the run goes on, and its last line says why it stopped


def _finish(returncode, interruption, log, report, files: RankFiles, scratch, show_all: bool):
    record = files.run_record()
    summary = record.summary if record is not None and returncode == 0 else None
    line, code, recorded = None, 0, None
    if interruption.signum is not None:
        kill_all(interruption.ranks)
        code = EXIT_INTERRUPTED
        line = (
            "interrupted before any rank started; nothing was written"
            if not interruption.ranks
            else _interrupted_line(record)
        )
    elif returncode != 0:
        recorded = files.root_cause()
        message = recorded[len(USER_ERROR) :] if recorded and recorded.startswith(USER_ERROR) else None
        code = EXIT_INPUT if message is not None else EXIT_INTERNAL
        line = message
    log_path = _close_log(log, scratch, record)
    if code == EXIT_INTERNAL:
        line = _failure_line(report, log_path, show_all, returncode, recorded)
    kept = record is None or files.copy_to(Path(record.dump_folder) / LOG_DIR / "ranks")
    if kept and not log_path.is_relative_to(scratch):
        shutil.rmtree(scratch, ignore_errors=True)
    if line is not None:
        print(f"train: {line}", file=sys.stderr)
    return code, summary


def _close_log(log, scratch: Path, record: RunRecord | None) -> Path:
    """The log closed, and moved into the dump folder once rank 0's checks had passed; where it is."""
    log.close()
    where = scratch / "train.log"
    if record is None:
        return where
    target = Path(record.dump_folder) / LOG_DIR / f"train-{time.strftime('%Y%m%d-%H%M%S')}.log"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(where, target)
    except OSError:
        return where  # a full disk: the log stays where it is, and the last line names it
    return target


def _interrupted_line(record: RunRecord | None) -> str:
    step = record.last_step if record is not None else None
    where = f"at step {step}" if step is not None else "before the first step"
    folder = Path(record.checkpoint_folder) if record is not None else None
    if record is not None and record.interrupted_with_checkpoint is not None:
        newest = record.interrupted_with_checkpoint if record.interrupted_with_checkpoint >= 0 else None
    elif folder is not None:  # the rank did not say (interrupted before its steps, or killed): read here
        from qwen3_titan_common.hf.start import newest_complete_step

        newest = newest_complete_step(folder)
    else:
        newest = None
    if newest is None:
        return f"interrupted {where}; no complete checkpoint yet: rerunning the same command starts over"
    return (
        f"interrupted {where}; newest complete checkpoint: step {newest} ({folder}); "
        "rerun the same command to resume"
    )


def _failure_line(
    report: TorchrunReport, log_path: Path, show_tracebacks: bool, returncode: int, recorded: str | None
) -> str:
    where = f"; the full log is in {log_path}"
    show = f" ({SHOW_TRACEBACK_ENV}=1 shows it here)" if not show_tracebacks else ""
    code = report.exitcode
    rank = f"rank {report.rank}" if report.rank is not None else "a rank"
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        oom = (
            " (out of memory? the system kills what exhausts host memory: lower --training.local_batch_size "
            "(--batch-size) or --training.seq_len (--seq-len); `train --dry-run` estimates the memory per rank)"
            if -code == signal.SIGKILL
            else ""
        )
        return f"{rank} was killed by {name}{oom}{where}{show}"
    if recorded is not None:
        return f"internal error in {rank}: {(recorded.splitlines() or [''])[0]}{where}{show}"
    return f"torchrun exited with status {returncode}{where}{show}"
