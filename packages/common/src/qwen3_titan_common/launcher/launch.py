"""The ``train`` console script behind every backend.

``train [launcher flags] [torchtitan flags]`` runs the upstream recipe's torchrun command (``plan``);
every flag the launcher does not own is passed to torchtitan unchanged. ``--print-cmd`` prints that
command instead of running it, ``--list-configs`` lists the backend's config functions, ``--dry-run``
checks a layout of any size on this machine, rank 0 rehearsed on torchtitan's fake process group
(``launcher.rehearse``), ``--check-layout`` runs
it at 2 layers beside one rank (``launcher.layout_check``), ``--print-sbatch`` prints a Slurm batch script that
runs the command on every node (``sbatch``).
"""

from __future__ import annotations

import os
import shlex
import sys
import time

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.launcher.config_names import list_config_functions
from qwen3_titan_common.launcher.dispatch import choose_backend, installed_backends, uv_parent_command
from qwen3_titan_common.launcher.interrupts import interrupted, notice_interrupts, raise_if_interrupted
from qwen3_titan_common.launcher.plan import (
    Backend,
    CommandLine,
    LaunchPlan,
    check_config_name,
    check_model_dir,
    plan_launch,
    read_command_line,
)
from qwen3_titan_common.launcher.rehearse import RehearsalFailed, show_failure
from qwen3_titan_common.launcher.supervise import run_torchrun, torchrun_executable
from qwen3_titan_common.protocols.rank_errors import SHOW_TRACEBACK_ENV, check_switches, show_tracebacks_asked
from qwen3_titan_common.protocols.summary import summary_lines


def _list_configs(module: str) -> int:
    functions = list_config_functions(module)
    if functions is None:
        print(f"train: --module {module}: no such importable module", file=sys.stderr)
        return 2
    width = max(len(f.name) for f in functions)
    for f in functions:
        print(f"{f.name:<{width}}  {f.summary}")
    return 0


def run(backend: Backend, line: CommandLine | list[str] | None = None) -> int:
    """``train`` with ``backend`` for ``line`` (a raw argv is parsed here; None: this process's own)."""
    try:
        if not isinstance(line, CommandLine):
            line = read_command_line(list(sys.argv[1:] if line is None else line))
    except UserInputError as err:
        print(f"train: {err}", file=sys.stderr)
        return 2
    argv = line.argv
    if line.opts.help:
        from qwen3_titan_common.launcher.help import print_help

        return print_help(backend, line)
    notice_interrupts()
    try:
        opts, plan = plan_launch(backend, line)
        if opts.list_configs:
            return _list_configs(plan.module)
        check_names(plan)
        if opts.print_cmd:
            for line in plan.knob_mapping:
                print(line, file=sys.stderr)
            print(plan.shell_line())
            return 0
        if opts.print_sbatch:
            from qwen3_titan_common.launcher.sbatch import print_sbatch

            return print_sbatch(backend, opts, plan, argv)
        if opts.dry_run:
            from qwen3_titan_common.launcher.rehearse import dry_run

            return dry_run(plan)
        if opts.check_layout:
            from qwen3_titan_common.launcher.layout_check import check_layout

            return check_layout(plan, lambda job: _run(job, user_command(argv), opts.show_traceback))
        settle_before_torchrun(plan)
        return _train(plan, argv, show_traceback=opts.show_traceback)
    except UserInputError as err:
        print(f"train: {err}", file=sys.stderr)
        return 2
    except RehearsalFailed as err:
        show_failure(err)
        print(f"train: internal error in {err} ({SHOW_TRACEBACK_ENV}=1 shows its output)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return _interrupted_before_any_rank()
    except Exception as err:
        if interrupted():
            # A Ctrl-C inside an import leaves that module half-loaded; what fails next is its consequence.
            return _interrupted_before_any_rank()
        if show_tracebacks_asked():
            raise
        reason = (str(err).strip().splitlines() or [""])[0]
        print(
            f"train: internal error in the launcher: {type(err).__name__}: {reason} "
            f"({SHOW_TRACEBACK_ENV}=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


def check_names(plan: LaunchPlan) -> None:
    """The launcher's own checks of what the command names, before any mode: the config function is one the
    module has, and a model directory given is one (its files are read again by every rank)."""
    check_config_name(plan.module, plan.config)
    check_model_dir(plan.flags)


def settle_before_torchrun(plan: LaunchPlan) -> None:
    """What a launch settles after its checks and before torchrun starts: the fit check's settings
    (``launcher.rehearse.check_before_launch``), added to the job's torchtitan flags."""
    from qwen3_titan_common.launcher.rehearse import check_before_launch
    from qwen3_titan_common.launcher.titan_flags import before_subcommands

    plan.passthrough = before_subcommands(plan.passthrough, tuple(check_before_launch(plan)))


def user_command(argv: list[str]) -> list[str]:
    """The command the user typed: ``uv run ... train ...`` as uv received it, else ``train ...``."""
    return uv_parent_command() or ["train", *argv]


def _train(plan: LaunchPlan, argv: list[str], *, show_traceback: bool) -> int:
    """torchrun, its ranks checking everything before they write, then the summary rank 0 left."""
    started = time.monotonic()
    command = user_command(argv)
    code, summary = _run(plan, command, show_traceback)
    python = ["uv", "run", "python"] if command[0] == "uv" else [sys.executable]
    wall_seconds = time.monotonic() - started
    lines = (
        summary_lines(summary, command=command, python=python, wall_seconds=wall_seconds) if summary else []
    )
    print("".join(f"[train] {line}\n" for line in lines), end="", flush=True)
    return code


def _run(plan: LaunchPlan, command: list[str], show_traceback: bool):
    """torchrun for ``plan``: its exit code and the summary rank 0 left. ``command``: as the user typed it, which
    the ranks' config takes as ``--launcher.command`` (protocols.summary.LauncherOptions)."""
    raise_if_interrupted()  # a Ctrl-C that a library swallowed while the launcher planned
    from qwen3_titan_common.launcher.titan_flags import before_subcommands

    # Before any subcommand (activation-checkpoint:full): tyro reads the flags after one as that subcommand's.
    titan = before_subcommands(plan.titan_args(), ("--launcher.command", shlex.join(command)))
    torchrun = [torchrun_executable(), *plan.torchrun_args(), "-m", "torchtitan.train", *titan]
    env = {**os.environ, **plan.env_updates}
    if plan.nnodes > 1:
        print(f"[train] {waiting_line(plan)}", file=sys.stderr, flush=True)
    return run_torchrun(torchrun, env, shown_env=plan.env_updates, show_tracebacks=show_traceback)


def waiting_line(plan: LaunchPlan, now: float | None = None) -> str:
    """What a node of a job of several waits for, where, and until when: torchrun's rendezvous gives up after
    its join timeout if a node never comes, and says nothing meanwhile."""
    from qwen3_titan_common.launcher.plan import RDZV_JOIN_TIMEOUT_S

    until = time.strftime(
        "%H:%M:%S", time.localtime((time.time() if now is None else now) + RDZV_JOIN_TIMEOUT_S)
    )
    return (
        f"node {plan.node_rank} of {plan.nnodes}: waiting at {plan.rdzv_endpoint} for all {plan.nnodes} nodes to "
        f"join (each runs this command with its own --node-rank); torchrun's rendezvous gives up at {until}, "
        f"in {RDZV_JOIN_TIMEOUT_S} s, if one does not come"
    )


def _interrupted_before_any_rank() -> int:
    print("train: interrupted before any rank started; nothing was written", file=sys.stderr)
    return 130


def main() -> None:
    """The shared ``train`` console script (also ``python -m qwen3_titan_common.launcher.launch``): choose the
    backend (``dispatch``), then run it."""
    try:
        check_switches()
        line = read_command_line(sys.argv[1:])
    except UserInputError as err:
        print(f"train: {err}", file=sys.stderr)
        sys.exit(2)
    backend, why = choose_backend(installed_backends(), line)
    if backend is None:
        print(f"train: {why}", file=sys.stderr)
        sys.exit(2)
    print(f"[train] backend: {backend.distribution} ({why})", file=sys.stderr)
    sys.exit(run(backend, line))


if __name__ == "__main__":
    main()
