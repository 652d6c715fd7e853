"""From a checked launch plan to a supervised torchrun: the dump folder locked, the run's log opened.

Everything that writes happens here, after ``cli.launch_checks`` passed: the dump folder (and its
lock, ``.train.lock``) is created, the run's log goes to ``<dump_folder>/logs/train-<time>.log``
(each local rank's own output to ``logs/ranks/``, torchrun's ``--log-dir``), and torchrun starts.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

from qwen3_titan_common.cli.launch_checks import check_before_launch
from qwen3_titan_common.cli.plan import Backend, LaunchPlan
from qwen3_titan_common.cli.supervise import RunContext, run_and_summarise, torchrun_executable
from qwen3_titan_common.runtime.dump_lock import HELD_ENV, DumpFolderLock

LOG_DIR = "logs"


def _with_rank_logs(command: list[str], rank_log_dir: str) -> list[str]:
    """torchrun's ``--log-dir`` (each local rank's output in a file) added before ``-m``."""
    at = command.index("-m")
    return [*command[:at], "--log-dir", rank_log_dir, *command[at:]]


def start_run(
    backend: Backend, plan: LaunchPlan, *, dry_run: bool = False, show_traceback: bool = False
) -> int:
    if dry_run:
        from qwen3_titan_common.cli.dry_run import dry_run as run_dry
        from qwen3_titan_common.cli.dry_run import fake_rank_env

        fake_rank_env(plan)
        checked = check_before_launch(backend, plan, dry_run=True)
        return run_dry(plan, checked.config, checked.pending)
    checked = check_before_launch(backend, plan)
    lock = DumpFolderLock(checked.dump_folder)
    lock.acquire()
    try:
        logs = checked.dump_folder / LOG_DIR
        context = RunContext(
            log_path=logs / f"train-{time.strftime('%Y%m%d-%H%M%S')}.log",
            rank_log_dir=logs / "ranks",
            checkpoint_folder=checked.checkpoint_folder,
            show_tracebacks=show_traceback,
        )
        command = _with_rank_logs([torchrun_executable(), *plan.command()[1:]], str(context.rank_log_dir))
        env_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env_updates.items())
        print(
            f"[train] {env_line + ' ' if env_line else ''}{shlex.join(command)}", file=sys.stderr, flush=True
        )
        env = {**os.environ, **plan.env_updates, HELD_ENV: "1"}
        return run_and_summarise(command, env, context)
    finally:
        lock.release()
