"""Whether a run can write where it writes, decided before it writes: the directory writable, room on disk;
and a full disk named by its path when a write fails anyway."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from qwen3_titan_common.errors import UserInputError

# What a write costs beyond its tensors' bytes: file-system blocks, DCP's per-file headers and
# metadata, config and tokenizer files. Measured on ext4 for the embedded default's checkpoint
# (docs/reliability.md, "Disk"): 10% plus 16 MiB covers it with room to spare.
DISK_MARGIN = 1.10
DISK_SLACK_BYTES = 16 * 1024**2


class DiskSpaceError(UserInputError):
    pass


def bytes_with_margin(needed_bytes: int) -> int:
    return int(needed_bytes * DISK_MARGIN) + DISK_SLACK_BYTES


def nearest_existing(path: Path) -> Path:
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_space(target: Path, needed_bytes: int, what: str) -> None:
    """Fail, naming ``target`` and both sizes, unless its file system has room for ``needed_bytes``."""
    free = shutil.disk_usage(nearest_existing(target)).free
    wanted = bytes_with_margin(needed_bytes)
    if free < wanted:
        raise DiskSpaceError(
            f"{target}: not enough free disk space for the {what}: needs about {wanted / 1e9:.2f} GB "
            f"(with margin), {free / 1e9:.2f} GB free; free some space or write elsewhere"
        )


def looks_full(path: Path) -> bool:
    """Whether ``path``'s file system is (nearly) out of space: how a failed write is told apart from
    other failures when the library reports ENOSPC as something else (torch.save, under DCP, raises
    ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``)."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free < DISK_SLACK_BYTES
    except OSError:
        return False


def disk_full_in(error: BaseException) -> bool:
    """Whether ``error``, or anything it wraps (DCP collects each rank's failure), is a full disk."""
    seen: set[int] = set()
    stack: list[object] = [error]
    while stack:
        item = stack.pop()
        if id(item) in seen or item is None:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno == errno.ENOSPC:
            return True
        if isinstance(item, BaseException):
            if "No space left on device" in str(item):
                return True
            stack += [item.__cause__, item.__context__]
            for value in getattr(item, "failures", {}).values() if hasattr(item, "failures") else ():
                stack += list(value) if isinstance(value, tuple) else [value]
    return False


def disk_full_message(path: Path, what: str) -> str:
    return (
        f"{path}: the disk filled up while writing the {what} (No space left on device); what was "
        "written of it is incomplete and will not be read: free space there, or pass another --dump_folder"
    )


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
