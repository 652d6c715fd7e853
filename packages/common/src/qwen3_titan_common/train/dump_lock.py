"""One training job per dump folder at a time: an OS file lock, released by the OS when its holder exits.

Two jobs writing one folder would both resume from (or both start) the same checkpoints and overwrite
each other's. The lock is ``<dump_folder>/.train.lock``, held with ``flock`` by rank 0 for the whole run,
taken once its checks passed. A holder that dies, even by SIGKILL, releases it, so a stale file never
blocks a rerun.

A job of several nodes writes one folder on a shared filesystem, and its rank 0 holds the lock for all of
them. It holds it shared, with the job's identity in the file (torchrun's run id, ``--rdzv-id``), so that the rank 0 of the same job restarted elsewhere by torchrun joins
while a host that died still holds its share, and any other job is refused. A single-node run holds the
lock exclusively. The file names the holder (job, host, PID) so a refused run can say who it is waiting
for; whether that holder is alive is the OS's call (the lock is released when it exits), never a PID
looked up on this host, which means nothing on a shared filesystem.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from qwen3_titan_common.errors import UserInputError

LOCK_NAME = ".train.lock"
# The first rank 0 of a job holds the lock exclusively for the moment it writes the job's identity; a
# restarted rank 0 of the job that comes then retries this long before it says the folder is busy.
JOIN_WAIT_SECONDS = 5.0


class DumpFolderBusy(UserInputError):
    pass


def _read_holder(f) -> dict:
    f.seek(0)
    text = f.read().strip()
    try:
        holder = json.loads(text)
    except ValueError:
        return {"pid": text or "unknown"}  # a lock file of an earlier version: its PID alone
    return holder if isinstance(holder, dict) else {"pid": text}


def describe_holder(holder: dict) -> str:
    parts = [f"PID {holder.get('pid', 'unknown')}"]
    if holder.get("host") and holder.get("host") != socket.gethostname():
        parts.append(f"on {holder['host']}")
    if holder.get("job"):
        parts.append(f"job {holder['job']}")
    return ", ".join(parts)


def lock_holder(folder: Path) -> str | None:
    """The PID written by the run that holds ``folder``'s lock, or None when nobody holds it."""
    path = Path(folder) / LOCK_NAME
    if not path.is_file():
        return None
    with open(path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return str(_read_holder(f).get("pid", "unknown"))
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return None


def busy_message(folder: Path, holder: str) -> str:
    return (
        f"--dump_folder {folder}: in use by another training run ({holder}); wait for it to finish, "
        "stop it, or pass another --dump_folder"
    )


def job_identity() -> str | None:
    """What every rank of one multi-node job shares, and another job does not: torchrun's run id (its
    ``--rdzv-id``, "a user-defined id that uniquely identifies the worker group for a job", which stays
    across restarts while the rendezvous' address may not). None for a single-node run, which holds the
    lock alone."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) <= int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))):
        return None
    return env.get("TORCHELASTIC_RUN_ID", "none")


class DumpFolderLock:
    """Held from :meth:`acquire` until :meth:`release` or the process exits. ``job``: the identity of a
    multi-node job (:func:`job_identity`), whose rank 0 may join it after a restart; None: held alone."""

    def __init__(self, folder: str | os.PathLike, job: str | None = None):
        self.folder = Path(folder)
        self.job = job
        self._file = None

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        f = open(self.folder / LOCK_NAME, "a+")  # noqa: SIM115 (held open for the whole run)
        try:
            self._take(f)
        except BaseException:
            f.close()
            raise
        os.set_inheritable(f.fileno(), False)
        self._file = f

    def _take(self, f) -> None:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._join(f)
            return
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": self.job}) + "\n")
        f.flush()
        if self.job is not None:
            # Shared from now on, for the job's own rank 0 after a restart. flock converts by unlocking first: a
            # rank of another job may take the lock in between, and then this one is the one refused.
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DumpFolderBusy(busy_message(self.folder, describe_holder(_read_holder(f)))) from None

    def _join(self, f) -> None:
        """The lock is held: share it when the holder is this rank's own job, else refuse."""
        deadline = time.monotonic() + (JOIN_WAIT_SECONDS if self.job is not None else 0.0)
        while True:
            holder = _read_holder(f)
            if self.job is None or holder.get("job") not in (None, self.job):
                break
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
                continue
            holder = _read_holder(f)
            if holder.get("job") == self.job:
                return
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            break
        raise DumpFolderBusy(busy_message(self.folder, describe_holder(holder)))

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def hold_in_rank(folder: str | os.PathLike) -> DumpFolderLock | None:
    """Rank 0 takes the lock for the job; the other ranks do not."""
    if os.environ.get("RANK", "0") != "0":
        return None
    lock = DumpFolderLock(folder, job_identity())
    lock.acquire()
    return lock
