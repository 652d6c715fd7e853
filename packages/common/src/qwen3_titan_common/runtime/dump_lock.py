"""One training run per dump folder at a time: an OS file lock, released by the OS when its holder exits.

Two runs writing one folder would both resume from (or both start) the same checkpoints and overwrite
each other's. The lock is ``<dump_folder>/.train.lock``, held with ``flock`` for the whole run by the
``train`` launcher (or, without it, by rank 0); it holds the holder's PID so a second run can name it.
A holder that dies, even by SIGKILL, releases it, so a stale file never blocks a rerun.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from qwen3_titan_common.errors import UserInputError

LOCK_NAME = ".train.lock"
# Set by the launcher for its ranks: the folder is already locked, by their parent.
HELD_ENV = "QWEN3_TITAN_DUMP_LOCK_HELD"


class DumpFolderBusy(UserInputError):
    pass


def lock_holder(folder: Path) -> str | None:
    """The PID written by the run that holds ``folder``'s lock, or None when nobody holds it."""
    path = Path(folder) / LOCK_NAME
    if not path.is_file():
        return None
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            return f.read().strip() or "unknown"
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return None


def busy_message(folder: Path, holder: str) -> str:
    return (
        f"--dump_folder {folder}: in use by another training run (PID {holder}); wait for it to finish, "
        "stop it, or pass another --dump_folder"
    )


class DumpFolderLock:
    """Held from :meth:`acquire` until :meth:`release` or the process exits."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._file = None

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        f = open(self.folder / LOCK_NAME, "a+")  # noqa: SIM115 (held open for the whole run)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise DumpFolderBusy(busy_message(self.folder, holder)) from None
        os.set_inheritable(f.fileno(), False)
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def hold_in_rank(folder: str | os.PathLike) -> DumpFolderLock | None:
    """Rank 0 of a run started without the launcher (upstream ``torchrun ... -m torchtitan.train``)
    takes the lock itself; under the launcher, which holds it already, no rank does."""
    if os.environ.get(HELD_ENV) or os.environ.get("RANK", "0") != "0":
        return None
    lock = DumpFolderLock(folder)
    lock.acquire()
    return lock
