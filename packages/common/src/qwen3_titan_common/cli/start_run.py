"""From a launch plan to a supervised torchrun: ranks importing while the launcher checks, then let go.

torchrun starts as soon as the launcher's cheap checks passed; its ranks import torch and torchtitan
while the launcher parses the run's config and runs every check on it (``cli.launch_checks``), and wait
at the launch gate (``runtime.launch_gate``) before they write anything. A failed check stops them and
ends the launch in one line, with nothing written; otherwise the dump folder is locked
(``.train.lock``), the run's log opened (``<dump_folder>/logs/train-<time>.log``) and the ranks let go.
Each local rank's own output (torchrun's ``--log-dir``, in a temporary directory while nothing may be
written) is kept in ``<dump_folder>/logs/ranks/`` when the run ends.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from qwen3_titan_common.cli.interrupts import raise_if_interrupted
from qwen3_titan_common.cli.launch_checks import check_before_launch
from qwen3_titan_common.cli.plan import Backend, LaunchPlan
from qwen3_titan_common.cli.supervise import RunContext, SupervisedRun, torchrun_executable
from qwen3_titan_common.runtime.dump_lock import HELD_ENV, DumpFolderLock, job_identity

LOG_DIR = "logs"


def _with_rank_logs(command: list[str], rank_log_dir: Path) -> list[str]:
    """torchrun's ``--log-dir`` (each local rank's output in a file) added before ``-m``."""
    at = command.index("-m")
    return [*command[:at], "--log-dir", str(rank_log_dir), *command[at:]]


def _keep_rank_logs(source: Path, destination: Path) -> None:
    try:
        shutil.copytree(source, destination, dirs_exist_ok=True)
    except OSError:
        return  # a full disk: the run's own log says what happened; the temporary copy stays
    shutil.rmtree(source, ignore_errors=True)


def start_run(
    backend: Backend,
    plan: LaunchPlan,
    *,
    dry_run: bool = False,
    show_traceback: bool = False,
    extra_env: dict[str, str] | None = None,
) -> int:
    """``extra_env``: more for the ranks' environment (the end-of-run summary's file, the typed command)."""
    raise_if_interrupted()
    if dry_run:
        from qwen3_titan_common.cli.dry_run import dry_run as run_dry
        from qwen3_titan_common.cli.dry_run import fake_rank_env

        fake_rank_env(plan)
        checked = check_before_launch(backend, plan, dry_run=True)
        raise_if_interrupted()
        return run_dry(plan, checked.config, checked.pending)
    rank_logs = Path(tempfile.mkdtemp(prefix="qwen3-titan-ranks-"))
    command = _with_rank_logs([torchrun_executable(), *plan.command()[1:]], rank_logs)
    env = {**os.environ, **plan.env_updates, **(extra_env or {}), HELD_ENV: "1"}
    # Early, with the ranks gated, only when the checks cost torchtitan's import; a launcher that has
    # imported it already (a warm process) checks in a fraction of a second and starts torchrun after.
    run = SupervisedRun(command, env) if "torchtitan.trainer" not in sys.modules else None
    try:
        checked = check_before_launch(backend, plan)
        raise_if_interrupted()  # a Ctrl-C that a library swallowed while the launcher checked
        # The launchers of one multi-node job share the folder; any other run is refused.
        lock = DumpFolderLock(
            checked.dump_folder, job_identity(plan.nnodes, plan.rdzv_endpoint, plan.rdzv_id)
        )
        lock.acquire()
    except BaseException:  # an input error, or Ctrl-C while checking: the ranks have written nothing
        if run is not None:
            run.abort()
        shutil.rmtree(rank_logs, ignore_errors=True)
        raise
    if run is None:
        run = SupervisedRun(command, env, gated=False)
    try:
        env_line = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env_updates.items())
        print(
            f"[train] {env_line + ' ' if env_line else ''}{shlex.join(command)}", file=sys.stderr, flush=True
        )
        logs = checked.dump_folder / LOG_DIR
        context = RunContext(
            log_path=logs / f"train-{time.strftime('%Y%m%d-%H%M%S')}.log",
            rank_log_dir=rank_logs,
            checkpoint_folder=checked.checkpoint_folder,
            show_tracebacks=show_traceback,
        )
        return run.follow(context)
    finally:
        lock.release()
        _keep_rank_logs(rank_logs, checked.dump_folder / LOG_DIR / "ranks")
