"""Which backend the shared ``train`` console script runs.

Every backend installs a console script named ``train``; in one workspace environment they would
overwrite each other (uv installs whichever synced last). So they all point at one dispatcher, and the
backend is chosen here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from qwen3_titan_common.cli.plan import Backend

BACKENDS_GROUP = "qwen3_titan.backends"
BACKEND_ENV = "QWEN3_TITAN_BACKEND"


def installed_backends() -> dict[str, Backend]:
    from importlib.metadata import entry_points

    found = {}
    for entry in entry_points(group=BACKENDS_GROUP):
        backend = entry.load()
        found[backend.distribution] = backend
    return dict(sorted(found.items()))


def _uv_parent_package() -> str | None:
    """The NAME of `uv run --package NAME train`, read from the parent process."""
    ppid = os.getppid()
    try:
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes()
        args = [a.decode() for a in raw.split(b"\0") if a]
    except OSError:
        try:  # macOS and other systems without /proc
            out = subprocess.run(["ps", "-o", "command=", "-p", str(ppid)], capture_output=True, text=True)
            args = out.stdout.split()
        except OSError:
            return None
    # args[0] is uv itself, or an interpreter running a uv wrapper script.
    if not any(Path(a).name in ("uv", "uv.exe") for a in args[:2]) or "run" not in args:
        return None
    for i, arg in enumerate(args):
        if arg == "--package" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--package="):
            return arg.split("=", 1)[1]
    return None


def choose_backend(installed: dict[str, Backend], argv: list[str]) -> tuple[Backend | None, str]:
    """(backend, how it was chosen) or (None, why none could be)."""
    from_env = os.environ.get(BACKEND_ENV)
    if from_env:
        if from_env in installed:
            return installed[from_env], f"{BACKEND_ENV}={from_env}"
        known = ", ".join(installed) or "none"
        return None, f"{BACKEND_ENV}={from_env}: not an installed backend (installed: {known})"
    from_uv = _uv_parent_package()
    if from_uv in installed:
        return installed[from_uv], f"uv run --package {from_uv}"
    modules = {b.module: b for b in installed.values()}
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--module" and i + 1 < len(argv) else None
        if arg.startswith("--module="):
            value = arg.split("=", 1)[1]
        if value in modules:
            return modules[value], f"--module {value}"
    if len(installed) == 1:
        only = next(iter(installed.values()))
        return only, f"the only backend installed, {only.distribution}"
    if not installed:
        return None, "no backend package is installed: `uv run --package native-backend train`"
    names = ", ".join(installed)
    return None, (
        f"several backends are installed ({names}): choose one with `uv run --package NAME train`, "
        f"{BACKEND_ENV}=NAME, or --module"
    )
