"""Finding the processes a test started, by walking /proc (Linux): torchrun's workers, Slurm's steps."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def _parent_of(stat: Path) -> int | None:
    try:
        # The command name (in parentheses) may hold spaces: the fields after its ")" are fixed.
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        parent = _parent_of(stat)
        if parent is not None:
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def environment(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with ({} when it is gone or not ours to read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def torchrun_worker(launcher_pid: int, local_rank: int, attempt: int = 0) -> int | None:
    """The pid of the worker with ``LOCAL_RANK=local_rank`` in torchrun restart ``attempt`` below ``launcher_pid``."""
    for pid in descendants(launcher_pid):
        env = environment(pid)
        if env.get("LOCAL_RANK") == str(local_rank) and env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt):
            # The worker itself, not a process it started (those inherit its environment).
            if "LOCAL_RANK" not in environment(_parent_of(Path(f"/proc/{pid}/stat")) or 0):
                return pid
    return None


def with_environment(name: str, value: str) -> list[int]:
    """Every process (but this one) whose environment holds ``name=value``: those a test tagged."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            if environment(int(entry.name)).get(name) == value:
                found.append(int(entry.name))
    return found


def kill(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
