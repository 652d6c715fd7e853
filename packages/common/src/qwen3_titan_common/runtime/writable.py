"""Whether a run could create and write a directory, decided without creating anything."""

from __future__ import annotations

import os
from pathlib import Path

from qwen3_titan_common.errors import UserInputError


class NotWritableError(UserInputError):
    pass


def check_writable_dir(path: str | os.PathLike, flag: str) -> None:
    """``path`` is a writable directory, or the nearest existing ancestor is one it can be made in.

    ``os.access`` reports a read-only file system (EROFS) even to root, which permission bits do not.
    """
    target = Path(path).expanduser().absolute()
    probe = target
    while not probe.exists():
        if probe.is_symlink():
            raise NotWritableError(f"{flag} {path}: {probe} is a dangling symbolic link")
        probe = probe.parent
    if not probe.is_dir():
        where = "is a file" if probe == target else f"cannot be created: {probe} is a file"
        raise NotWritableError(f"{flag} {path}: {where}, not a directory; pass a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "is not writable" if probe == target else f"cannot be created: {probe} is not writable"
        readonly = " (read-only file system)" if _read_only(probe) else ""
        raise NotWritableError(f"{flag} {path}: {where}{readonly}; pass a directory you can write to")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
