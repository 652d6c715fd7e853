"""How a rank ends and what it leaves for the ``train`` launcher: one-line errors, its run's folders.

torchtitan and the libraries under it report a full disk, a read-only dump folder, a damaged
safetensors file or a diverged loss as their own exceptions, deep in a traceback. These are re-raised
as one-line ``UserInputError``s naming the path, file or step and what to do; anything else is left as
it is (an internal error). A flag torchtitan's parser refuses is raised as one too, naming the flag as typed
(:func:`record_refused_flags`), where tyro would print its box and exit.

A rank that stops records why in torchelastic's own error file (``TORCHELASTIC_ERROR_FILE``, which
torchrun sets for every rank under its ``--log-dir`` and from which it reports the first failure): that
file is the one channel of errors to the ``train`` launcher, which reads it after torchrun returns. On
stderr, which the launcher keeps in the run's log and which a bare ``torchrun`` shows, the rank says in one
line that it stops; a user error prints no traceback (it stays in the error file;
``QWEN3_TITAN_SHOW_TRACEBACK=1`` prints it). What else a rank leaves for the launcher is one file beside
the error file (``protocols.summary.RunRecord``).
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.protocols.short_flags import KNOBS, flag_spelling
from qwen3_titan_common.runtime.disk import disk_full_in, looks_full

STOPPED = "[stopped] "
USER_ERROR = "UserInputError: "  # how torchelastic's error file begins the message of a user error
SHOW_TRACEBACK_ENV = "QWEN3_TITAN_SHOW_TRACEBACK"
_SWITCH_ON = ("1", "true", "yes", "on")
_SWITCH_OFF = ("0", "false", "no", "off", "")


def show_tracebacks_asked() -> bool:
    """``QWEN3_TITAN_SHOW_TRACEBACK`` read as a switch: 1, true, yes or on shows the tracebacks of user errors;
    0, false, no, off, empty or unset does not (any case). A value that is neither is refused by the launcher
    before any rank starts (:func:`check_switches`), and is off where no launcher checked it."""
    return os.environ.get(SHOW_TRACEBACK_ENV, "").strip().lower() in _SWITCH_ON


def check_switches() -> None:
    """Refuse, in one line, a boolean environment switch of ours whose value is neither on nor off."""
    value = os.environ.get(SHOW_TRACEBACK_ENV)
    if value is not None and value.strip().lower() not in _SWITCH_ON + _SWITCH_OFF:
        raise UserInputError(
            f"{SHOW_TRACEBACK_ENV}={value!r}: expected 1, true, yes or on (show tracebacks), or 0, false, no, "
            "off or empty (do not)"
        )


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
        if _out_of_memory(link):
            reason = (str(link).strip().splitlines() or ["out of memory"])[-1].strip()
            return RunStoppedError(
                f"out of memory in rank {os.environ.get('RANK', '0')} ({reason[:160]}); lower "
                "--training.local_batch_size (--batch-size) or --training.seq_len (--seq-len), recompute "
                "activations (activation-checkpoint:full as the last argument), or shard over more ranks; `train --dry-run` "
                "with the same flags estimates the memory per rank"
            )
        if type(link).__name__ == "SafetensorError":
            reason = (str(link).strip().splitlines() or ["unreadable"])[0]
            return RunStoppedError(
                f"{model_dir or where}: a safetensors file could not be read while loading ({reason}); download "
                "the checkpoint again, and check it with `verify-checkpoint DIR`"
            )
    return None


# How each device's allocator says it is out of memory: CUDA raises torch.OutOfMemoryError; the CPU
# allocator a RuntimeError from c10's alloc_cpu; the Neuron runtime reports NRT's allocation failure.
_OUT_OF_MEMORY = re.compile(
    r"DefaultCPUAllocator: can't allocate memory|CUDA out of memory|Failed to allocate .* (?:HBM|device memory)"
)


def _out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or bool(_OUT_OF_MEMORY.search(str(error)))


def record_refused_flags(config) -> None:
    """From now on in this process, a command line torchtitan's parser (tyro) refuses for ``config`` (the config
    function's, which the flags change) raises a one-line UserInputError naming the flag as typed and what was
    expected, which a rank records as any other error (:func:`record_uncaught_errors`), instead of tyro printing
    its box and exiting. Called by every config function, just before torchtitan parses the flags."""
    from qwen3_titan_common.compat import raise_on_refused_command_line

    raise_on_refused_command_line(
        lambda refused: UserInputError(refused_message(refused, sys.argv[1:], config))
    )


_BOOLEAN_TEXTS = ("True", "False", "true", "false")


def refused_message(refused, argv: list[str], config=None) -> str:
    """One line for what tyro refused (``compat.RefusedCommandLine``); ``argv``: the command line as given, to
    name a flag as it was typed; ``config``: the config the flags apply to, whose flags a misspelling is
    matched against."""
    kind = refused.kind
    if kind == "unrecognized":
        unknown = list(refused.tokens)
        typed = [a for a in argv if any(u and (a == u or a.endswith("=" + u)) for u in unknown)]
        # A flag's stray value is reported beside it; the flag is what the user mistyped.
        flags = [a for a in typed or unknown if a.startswith("-")] or typed or unknown
        message = f"{', '.join(flags)}: not a flag of this config"
        if any("=" in a and a.split("=", 1)[1] in _BOOLEAN_TEXTS for a in typed):
            return message + " (booleans are written --section.name or --section.no-name, without =)"
        hint = _close_flag(flags, config)
        return message + (f"; perhaps you meant {hint}" if hint else "")
    flag = _as_typed(refused.flag, argv) if refused.flag else None
    if kind == "invalid_choice":
        return f"{flag} {refused.value}: expected one of {', '.join(refused.choices)}"
    if kind == "invalid_value":
        if flag is None and refused.section:
            section = flag_spelling(f"--{refused.section}.")
            typed = [a.split("=", 1)[0] for a in argv if flag_spelling(a).startswith(section)]
            flag = ", ".join(dict.fromkeys(typed)) or f"--{refused.section}.*"
        if flag is None or refused.message.lstrip().startswith("--"):
            return _expected(refused.message)  # a section's own check names its flag itself
        return f"{flag}: {_expected(refused.message)}"
    if kind == "missing_value":
        return f"{flag}: expected a value after it"
    if kind == "fixed":
        return f"{flag}: cannot be set on the command line (got {refused.value!r})"
    return f"{flag}: {refused.message}" if flag else f"the command line was refused: {refused.message}"


def _expected(message: str) -> str:
    """Python's conversion errors said as what was expected."""
    for prefix, expected in (
        ("invalid literal for int() with base 10: ", "expected an integer, got "),
        ("could not convert string to float: ", "expected a number, got "),
    ):
        if message.startswith(prefix):
            return expected + message[len(prefix) :]
    return message


def _as_typed(flag: str, argv: list[str]) -> str:
    """``flag`` as the command line spelled it (tyro names it with hyphens, torchtitan's docs with underscores)."""
    return next((a.split("=", 1)[0] for a in reversed(argv) if flag_spelling(a) == flag_spelling(flag)), flag)


def _close_flag(flags: list[str], config) -> str | None:
    """The flag closest to a misspelled one: the launcher's short flags first (``--stpes``: ``--steps``), then
    the config's own (``--training.stepz``: ``--training.steps``)."""
    import difflib

    short = {knob.flag: f"{knob.flag} (= {knob.field})" for knob in KNOBS}
    long = {flag_spelling(name): name for name in _config_flags(config)} if config is not None else {}
    for flag in flags:
        if close := difflib.get_close_matches(flag.split("=", 1)[0], list(short), n=1, cutoff=0.75):
            return short[close[0]]
        if close := difflib.get_close_matches(flag_spelling(flag), list(long), n=1, cutoff=0.75):
            return long[close[0]]
    return None


def _config_flags(config, prefix: str = "--") -> list[str]:
    """The flags of ``config``'s fields (nested dataclasses as dotted sections), those hidden from the command
    line (``tyro.conf.Suppress``) left out."""
    import dataclasses

    flags = []
    for f in dataclasses.fields(config):
        if "Suppress" in str(f.type):
            continue
        value = getattr(config, f.name, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            flags += _config_flags(value, f"{prefix}{f.name}.")
        else:
            flags.append(f"{prefix}{f.name}")
    return flags


_recorded: dict[int, bool] = {}  # id of each error this rank recorded -> whether it is a user error


def _excepthook(kind, value, traceback, previous=sys.excepthook) -> None:
    if id(value) not in _recorded and not isinstance(value, KeyboardInterrupt):
        # An error no trainer caught (a config function's, torchtitan's before the trainer): recorded too.
        record_stop(value, user_error=isinstance(value, UserInputError))
    if _recorded.get(id(value)) and not show_tracebacks_asked():
        return  # a user error: its one line was said; the traceback stays in the error file
    previous(kind, value, traceback)


def record_uncaught_errors() -> None:
    """In a rank under torchrun (its error file set), every error that ends the process is recorded in
    torchelastic's error file, as torchelastic's ``record`` does for an entry point decorated with it
    (torchtitan's ``main`` is not). Called by every config function: the first code of ours a rank runs."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        sys.excepthook = _excepthook


def record_stop(error: BaseException, user_error: bool) -> None:
    """Record ``error`` in torchelastic's error file, and say on stderr in one line that this rank stops."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    if id(error) in _recorded:
        return
    _recorded[id(error)] = user_error
    # Recorded as a plain UserInputError, so that its name says to the launcher whose it is to fix.
    ErrorHandler().record_exception(UserInputError(str(error)) if user_error else error)
    kind = "" if user_error else f"internal error: {type(error).__name__}: "
    reason = (str(error).strip().splitlines() or [""])[0]
    print(f"{STOPPED}{kind}{reason}", file=sys.stderr, flush=True)
    if user_error:
        sys.excepthook = _excepthook  # its traceback is not printed
        _no_restart()


def _no_restart() -> None:
    """Ask torchrun's agent (this rank's parent) to stop rather than restart the ranks.

    A user error (a flag, a record, a checkpoint that does not match) recurs on every restart, and
    torchrun's ``--max-restarts`` would replay it that many times before the run ends. The agent restarts
    the ranks once it sees one exit, so the rank, whose error file is written already, stops the agent
    first: SIGTERM is torchrun's own way to shut its workers down, and its other nodes then leave the
    rendezvous too.
    """
    import signal

    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
        return  # no restart would come
    parent = os.getppid()
    if parent > 1:
        try:
            os.kill(parent, signal.SIGTERM)
        except OSError:
            pass


@contextmanager
def rank_errors(config: Callable[[], object]) -> Iterator[None]:
    """Re-raise the user's failures as one-line errors, and say why the rank stops (module docstring);
    ``config()`` is the run's config, for its dump folder and model dir."""
    try:
        yield
    except UserInputError as error:
        record_stop(error, user_error=True)
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        run = config()
        translated = translate(error, str(run.dump_folder), getattr(run.hf, "model_dir", None))
        if translated is None:
            record_stop(error, user_error=False)
            raise
        record_stop(translated, user_error=True)
        raise translated from None
