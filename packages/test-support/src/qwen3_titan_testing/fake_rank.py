"""Rank 0 of a planned job in the test's own process: the config torchtitan parses from the job's command line,
checked as its rank checks it, on torchtitan's fake process group. For tests of the parts a rehearsal
(``train.rehearsal``, which the launcher runs in a child process) is made of, called one by one; the whole
path runs through ``train --dry-run`` in the tests that launch it.
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager, redirect_stderr, redirect_stdout

from qwen3_titan_common.launcher.rehearse import REHEARSAL_FLAGS
from qwen3_titan_common.launcher.titan_flags import before_subcommands


def parse_as_rank(plan, extra_flags: tuple[str, ...] = ()):
    """torchtitan's config for ``plan``'s ranks, parsed as a rank parses it (its parse warnings dropped); what it
    refuses is a one-line UserInputError."""
    from qwen3_titan_common.errors import UserInputError, first_line
    from qwen3_titan_common.runtime.device_autoload import ensure_installed

    ensure_installed()
    from torchtitan.config import ConfigManager

    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
            return ConfigManager().parse_args(before_subcommands(plan.titan_args(), extra_flags))
    except UserInputError:
        raise
    except SystemExit:  # a config function not ours: tyro printed its own box
        raise UserInputError(f"--config {plan.config}: the command line did not parse") from None
    except Exception as err:  # torchtitan's validation rejected a value
        raise UserInputError(f"--config {plan.config} with these flags: {first_line(err)}") from None


@contextmanager
def as_fake_rank(plan):
    """This process as rank 0 of ``plan`` on torchtitan's fake process group, and as it was afterwards."""
    import torch.distributed as dist
    from qwen3_titan_common.train.rehearsal import rank0_environment

    saved = dict(os.environ)
    os.environ.update(
        {**rank0_environment(plan.world_size, plan.nproc_per_node), "QWEN3_TITAN_DEVICE": "cpu"}
    )
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def checked_config(plan):
    """``plan``'s config as its rehearsed rank 0 resolves and checks it (inside :func:`as_fake_rank`), and what
    this machine could not confirm."""
    from qwen3_titan_common.train.rehearsal import checked_config as rank_checked
    from qwen3_titan_common.train.trainer import Qwen3Trainer

    return rank_checked(parse_as_rank(plan, REHEARSAL_FLAGS), Qwen3Trainer)
