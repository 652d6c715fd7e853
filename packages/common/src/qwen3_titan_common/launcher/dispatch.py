"""Which backend the shared ``train`` console script runs.

Every backend installs a console script named ``train``; in one workspace environment they would
overwrite each other (uv installs whichever synced last). So they all point at one dispatcher, and the
backend is chosen here, in this order:

1. ``QWEN3_TITAN_BACKEND=NAME``;
2. ``--module M`` naming a backend's own module (its package's ``BACKEND``, imported by that name where no
   entry point lists it: the packages only on ``PYTHONPATH``);
3. ``--config NAME``: the installed backend that provides NAME (its config registry, read from source by
   ``config_names``; with ``--module neuron_qwen3``, the backend registering the recipe name). Names are
   unique across backends but for the tiny ones (``debug``, ``debug_moe``); when several installed backends
   provide NAME, ``uv run --package`` picks among them, else the error lists them;
4. ``uv run --package NAME train``, read from the parent process;
5. the only backend installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from qwen3_titan_common.launcher.config_names import list_config_functions
from qwen3_titan_common.launcher.plan import Backend, CommandLine

BACKENDS_GROUP = "qwen3_titan.backends"
BACKEND_ENV = "QWEN3_TITAN_BACKEND"
RECIPE_MODULE = "neuron_qwen3"


def installed_backends() -> dict[str, Backend]:
    from importlib.metadata import entry_points

    found = {}
    for entry in entry_points(group=BACKENDS_GROUP):
        backend = entry.load()
        found[backend.distribution] = backend
    return dict(sorted(found.items()))


def declared_backend(module: str) -> Backend | None:
    """The ``BACKEND`` a backend package declares, imported by its ``--module`` name: found even where
    no entry point is (the packages only on ``PYTHONPATH``)."""
    import importlib

    try:
        backend = getattr(importlib.import_module(module), "BACKEND", None)
    except ImportError:
        return None
    return backend if isinstance(backend, Backend) else None


def uv_parent_command() -> list[str] | None:
    """The parent process's command line when it is `uv run ...` (the user's command, uv spelled `uv`)."""
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
    for start, arg in enumerate(args[:2]):
        if Path(arg).name in ("uv", "uv.exe") and "run" in args[start + 1 :]:
            return ["uv", *args[start + 1 :]]
    return None


def _uv_parent_package() -> str | None:
    """The NAME of `uv run --package NAME train`, read from the parent process."""
    args = uv_parent_command() or []
    for i, arg in enumerate(args):
        if arg == "--package" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--package="):
            return arg.split("=", 1)[1]
    return None


def recipe_providers(installed: dict[str, Backend], config: str) -> list[Backend]:
    """The installed backends registering recipe name ``config`` (``--module neuron_qwen3``)."""
    from importlib.metadata import entry_points

    from neuron_qwen3.config_registry import RECIPE_GROUP

    names = {entry.dist.name for entry in entry_points(group=RECIPE_GROUP, name=config) if entry.dist}
    return [backend for name, backend in installed.items() if name in names]


def config_providers(installed: dict[str, Backend], module: str | None, config: str) -> list[Backend]:
    """The installed backends that provide ``--config config`` (under ``--module module``, when given)."""
    if module == RECIPE_MODULE:
        return recipe_providers(installed, config)
    found = []
    for backend in installed.values():
        functions = list_config_functions(backend.module)
        if functions is not None and any(f.name == config for f in functions):
            found.append(backend)
    return found


def _config_names(installed: dict[str, Backend]) -> str:
    listed = []
    for backend in installed.values():
        functions = list_config_functions(backend.module) or []
        listed.append(f"{backend.distribution}: {', '.join(f.name for f in functions)}")
    return "; ".join(listed)


def choose_backend(installed: dict[str, Backend], line: CommandLine) -> tuple[Backend | None, str]:
    """(backend, how it was chosen) or (None, why none could be), from the command line's ``--module`` and
    ``--config`` and the environment."""
    module, config = line.opts.module, line.opts.config
    from_env = os.environ.get(BACKEND_ENV)
    if from_env:
        if from_env in installed:
            return installed[from_env], f"{BACKEND_ENV}={from_env}"
        known = ", ".join(installed) or "none"
        return None, f"{BACKEND_ENV}={from_env}: not an installed backend (installed: {known})"
    modules = {b.module: b for b in installed.values()}
    if module in modules:
        return modules[module], f"--module {module}"
    if module is not None and module != RECIPE_MODULE and (declared := declared_backend(module)):
        return declared, f"--module {module}"
    if not installed:
        return None, "no backend package is installed: `uv run --package native-backend train`"
    from_uv = _uv_parent_package()
    if config is not None:
        providers = config_providers(installed, module, config)
        if len(providers) == 1:
            return providers[0], f"--config {config} is {providers[0].distribution}'s"
        if from_uv in installed and installed[from_uv] in providers:
            return installed[from_uv], f"uv run --package {from_uv}"
        if len(providers) > 1:
            names = ", ".join(b.distribution for b in providers)
            return None, (
                f"--config {config} is provided by several installed backends ({names}): choose one with "
                f"`uv run --package NAME train`, {BACKEND_ENV}=NAME, or --module"
            )
        if module == RECIPE_MODULE:
            from neuron_qwen3.config_registry import RECIPE_PROVIDERS, missing_provider_message

            if config in RECIPE_PROVIDERS:
                return None, missing_provider_message(config) or f"--config {config}: no provider found"
            return (
                None,
                f"--config {config}: not a recipe name of {RECIPE_MODULE}; recipe names: "
                + ", ".join(RECIPE_PROVIDERS),
            )
        if module is None:
            return None, (
                f"--config {config}: no installed backend provides this config function; "
                f"installed: {_config_names(installed)}"
            )
    if from_uv in installed:
        return installed[from_uv], f"uv run --package {from_uv}"
    if len(installed) == 1:
        only = next(iter(installed.values()))
        return only, f"the only backend installed, {only.distribution}"
    names = ", ".join(installed)
    return None, (
        f"several backends are installed ({names}): choose one with `uv run --package NAME train`, "
        f"{BACKEND_ENV}=NAME, --module, or a --config only one of them provides"
    )
