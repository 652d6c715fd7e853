"""The run's full config, built once in the launcher, and every check that needs no rank run on it.

The config is what each rank will build: torchtitan's ``ConfigManager().parse_args`` over the same
``--module``/``--config``/flags torchrun passes them, then the trainer's own ``run_config`` (where the
weights come from, the architecture of ``--hf.model_dir``, the checkpoint folder's model record).
``train.preflight.check_run`` then runs on it: the same function every rank runs first, so a run the
launcher lets through is one its ranks' checks accept, and ``--dry-run`` shares the same path.
The backend's own ``preflight`` hook gets this config too, so one parse serves every check.

Nothing here writes: an input error costs the parse (torchtitan's import, a few seconds) and one line.
"""

from __future__ import annotations

import dataclasses
import io
import re
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen3_titan_common.cli.plan import Backend, LaunchError, LaunchPlan
from qwen3_titan_common.cli.supervise import error_from_output
from qwen3_titan_common.errors import UserInputError

# Flags a dry run adds: rank 0 of the job on torchtitan's fake process group, nothing compiled.
DRY_RUN_FLAGS = ("--comm.mode", "fake_backend", "--compile.no-enable")


@dataclass(frozen=True)
class CheckedRun:
    config: Any  # the Trainer.Config each rank will build
    dump_folder: Path
    checkpoint_folder: Path
    # A dry run plans a job for other machines: what it could not confirm on this one (weights not
    # downloaded here, this disk's free space) is listed rather than failed.
    pending: tuple[str, ...] = ()


def parse_run_config(plan: LaunchPlan, extra_flags: tuple[str, ...] = ()) -> Any:
    """torchtitan's config for this launch, parsed as a rank parses it; a rejected flag is one line.

    torchtitan's parser (tyro) prints its errors as a box on stderr and exits; that text is kept
    from the terminal and its message becomes the LaunchError. Warnings printed while parsing are
    the ranks' to print, so they are dropped here.
    """
    from qwen3_titan_common.runtime.device_autoload import ensure_installed

    ensure_installed()
    from torchtitan.config import ConfigManager

    captured = io.StringIO()
    try:
        with redirect_stdout(captured), redirect_stderr(captured):
            return ConfigManager().parse_args([*plan.titan_args(), *extra_flags])
    except UserInputError:
        raise
    except SystemExit:
        text = captured.getvalue()
        message = error_from_output(text.splitlines()) or parser_error(text, plan.titan_args())
        raise LaunchError(
            message or "the command line did not parse (run with --help for the flags)"
        ) from None
    except Exception as err:  # a config function or torchtitan's validation rejected a value
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise LaunchError(f"--config {plan.config} with these flags: {reason}") from None


_RULE = re.compile(r"^\s*-{20,}\s*$")
# tyro's "Error parsing <where>: " before a message that names its flag itself.
_SECTION_PREFIX = re.compile(r"^Error parsing (?:[\w.-]+: (?=--)|(?=--[\w.-]+: ))")


def parser_error(text: str, argv: list[str]) -> str | None:
    """The message of tyro's error panel as printed without a terminal: a title, a rule, the message,
    a rule, then sections such as "Perhaps you meant:"; the message is rejoined into one line."""
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if _RULE.match(line)]
    if len(rules) < 2:
        return None
    message = " ".join(line.strip() for line in lines[rules[0] + 1 : rules[1]] if line.strip())
    message = _SECTION_PREFIX.sub("", message)
    if message.startswith("Unrecognized options:"):
        unknown = [u.strip() for u in message.split(":", 1)[1].split(",")]
        typed = [a for a in argv if any(u and (a == u or a.endswith("=" + u)) for u in unknown)]
        message = f"{', '.join(typed or unknown)}: not a flag of this config"
        if any("=" in a and a.split("=", 1)[1] in ("True", "False", "true", "false") for a in typed):
            message += " (booleans are written --section.name or --section.no-name, without =)"
        after = lines[rules[1] :]
        at = next((i for i, line in enumerate(after) if "Perhaps you meant" in line), None)
        if at is not None:
            hint = next((line.split()[0] for line in after[at + 1 :] if line.strip().startswith("--")), None)
            if hint:
                message += f"; perhaps you meant {hint}"
    return message


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def check_before_launch(backend: Backend, plan: LaunchPlan, *, dry_run: bool = False) -> CheckedRun:
    """Parse the run's config and run every check that needs no rank; raises a one-line UserInputError."""
    from qwen3_titan_common.train.preflight import check_run
    from qwen3_titan_common.train.trainer import Qwen3Trainer

    parsed = parse_run_config(plan, DRY_RUN_FLAGS if dry_run else ())
    if not isinstance(parsed, Qwen3Trainer.Config):
        # Another package's config (--module): its own trainer checks it.
        return CheckedRun(
            parsed, Path(parsed.dump_folder), Path(parsed.dump_folder) / parsed.checkpoint.folder
        )
    pending: list[str] = []
    config = _run_config(parsed, plan.config, pending if dry_run else None)
    check_run(config, plan.world_size, deferred=pending if dry_run else None)
    if backend.preflight is not None:
        problem = backend.preflight(config)
        if problem is not None:
            raise LaunchError(problem)
    return CheckedRun(
        config=config,
        dump_folder=Path(config.dump_folder),
        checkpoint_folder=Path(config.dump_folder) / config.checkpoint.folder,
        pending=tuple(pending),
    )


def _run_config(parsed: Any, config_name: str, pending: list[str] | None) -> Any:
    """The trainer's own ``run_config``; for a dry run, a config function's model directory that is not
    on this machine is listed in ``pending`` and the config's built-in architecture is laid out."""
    from qwen3_titan_common.hf.errors import CheckpointError
    from qwen3_titan_common.train.trainer import run_config

    quiet = io.StringIO()
    model_dir = parsed.hf.model_dir
    try:
        with redirect_stdout(quiet), redirect_stderr(quiet):
            return run_config(parsed)[1]
    except UserInputError as err:
        missing = bool(model_dir) and not Path(model_dir).expanduser().exists()
        if pending is None or not isinstance(err, CheckpointError) or not missing:
            raise
        pending.append(str(err))
    except (ValueError, AssertionError) as err:
        # torchtitan validates the config again once the model directory's architecture is in it.
        raise LaunchError(f"--config {config_name} with these flags: {_first_line(err)}") from None
    without = dataclasses.replace(parsed, hf=dataclasses.replace(parsed.hf, model_dir=None))
    with redirect_stdout(quiet), redirect_stderr(quiet):
        return run_config(without)[1]
