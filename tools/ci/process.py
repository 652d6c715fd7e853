"""Running commands: output echoed as it comes, and the environments a package's run sees.

Output goes through ``emit``: to the terminal, or, in a step that runs beside another (``lanes``),
to that step's buffer, printed as one block when the step ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tools.ci.packages import ROOT

_TERMINAL = threading.Lock()
_sink = threading.local()


def emit(text: str) -> None:
    buffer = getattr(_sink, "buffer", None)
    if buffer is not None:
        buffer.append(text)
    else:
        emit_block(text)


def emit_block(text: str) -> None:
    """Writes text to the terminal at once: no other step's line lands inside it."""
    with _TERMINAL:
        sys.stdout.write(text)
        sys.stdout.flush()


@contextmanager
def buffered() -> Iterator[list[str]]:
    """This thread's output collects in the yielded list instead of reaching the terminal."""
    _sink.buffer = lines = []
    try:
        yield lines
    finally:
        _sink.buffer = None


def say(message: str) -> None:
    emit(f"ci: {message}\n")


def stream(cmd: list[str], env: dict[str, str], cwd: Path = ROOT, echo: bool = True) -> tuple[int, str]:
    """Runs cmd, echoing its output as it comes; returns the exit status and the output."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if echo:
            emit(line)
    return proc.wait(), "".join(lines)


def bin_dir(env_dir: Path) -> Path:
    return env_dir / ("Scripts" if os.name == "nt" else "bin")


def isolated_environ(env_dir: Path) -> dict[str, str]:
    """The caller's environment, activated for env_dir, with the caller's virtualenv off PATH."""
    env = dict(os.environ)
    caller_venv = env.pop("VIRTUAL_ENV", None)
    for name in ("PYTHONPATH", "PYTHONHOME", "UV_PROJECT_ENVIRONMENT"):
        env.pop(name, None)
    path = env.get("PATH", "").split(os.pathsep)
    if caller_venv:
        path = [p for p in path if p and Path(p) != bin_dir(Path(caller_venv))]
    env["PATH"] = os.pathsep.join([str(bin_dir(env_dir)), *path])
    env["VIRTUAL_ENV"] = str(env_dir)
    return env


def uv_environ(env_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["UV_PROJECT_ENVIRONMENT"] = str(env_dir)
    return env
