"""Failures inside a rank that are the user's to fix, turned into one-line ``UserInputError``s.

torchtitan and the libraries under it report a full disk, a read-only dump folder, a damaged
safetensors file or a diverged loss as their own exceptions, deep in a traceback. The ``train``
launcher shows the last line of a rank's ``UserInputError`` instead of that traceback, so these
are re-raised as one, naming the path, file or step and what to do; anything else is left as it
is (an internal error: the launcher keeps its traceback in the log).
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.runtime.disk import disk_full_in, looks_full
from qwen3_titan_common.runtime.error_channel import report

_NON_FINITE_LOSS = re.compile(r"Loss is not finite \(global_avg_loss=([^)]*)\) at step (\d+)")
_NOT_WRITABLE = {
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is a file",
    errno.EEXIST: "a file is in the way",
}


class RunStoppedError(UserInputError):
    """The run cannot go on for a reason the user can act on (disk, permissions, divergence)."""


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def translate(error: BaseException, where: str, model_dir: str | None = None) -> UserInputError | None:
    """The one-line error ``error`` stands for, or None when it is not the user's to fix.

    ``where``: the run's dump folder (a full disk is looked for there); ``model_dir``: the weights loaded.
    """
    if isinstance(error, UserInputError):
        return None
    if disk_full_in(error) or looks_full(Path(where)):
        path = next((e.filename for e in _chain(error) if isinstance(e, OSError) and e.filename), where)
        return RunStoppedError(
            f"{path}: the disk filled up (No space left on device); free space there or pass another --dump_folder"
        )
    for link in _chain(error):
        match = _NON_FINITE_LOSS.search(str(link))
        if match:
            return RunStoppedError(
                f"step {match.group(2)}: the loss is not finite ({match.group(1)}), training stopped; lower the "
                "learning rate (--optimizer.param-groups.0.optimizer-kwargs.lr), check the data, or resume from an "
                "earlier step checkpoint"
            )
        if isinstance(link, OSError) and link.errno in _NOT_WRITABLE and link.filename:
            return RunStoppedError(
                f"{link.filename}: cannot be written ({_NOT_WRITABLE[link.errno]}); pass a --dump_folder you can write to"
            )
        if type(link).__name__ == "SafetensorError":
            reason = (str(link).strip().splitlines() or ["unreadable"])[0]
            return RunStoppedError(
                f"{model_dir or where}: a safetensors file could not be read while loading ({reason}); download "
                "the checkpoint again, and check it with `verify-checkpoint DIR`"
            )
    return None


@contextmanager
def rank_errors(config: Callable[[], object]) -> Iterator[None]:
    """Re-raise the user's failures as one-line errors, each also sent to the launcher
    (``runtime.error_channel``); ``config()`` is the run's config, for its dump folder and model dir."""
    try:
        yield
    except UserInputError as error:
        report(str(error))
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        run = config()
        translated = translate(error, str(run.dump_folder), getattr(run.hf, "model_dir", None))
        if translated is None:
            raise
        report(str(translated))
        raise translated from None
