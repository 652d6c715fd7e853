"""A package's own environment, ``.ci-envs/<package>``: the package, what it declares, its groups."""

from __future__ import annotations

from pathlib import Path

from tools.ci.packages import ROOT, Package
from tools.ci.process import emit, stream, uv_environ

ENVS = ROOT / ".ci-envs"
TEST_RUNNER = "pytest"


def missing_test_runner(package: Package) -> str:
    """One line when the package's dependency groups do not bring pytest (its tests could not run), else ''."""
    if TEST_RUNNER in package.group_requirements:
        return ""
    pyproject = package.folder / "pyproject.toml"
    return (
        f"{pyproject.relative_to(ROOT) if pyproject.is_relative_to(ROOT) else pyproject}: "
        f"no dependency group lists {TEST_RUNNER}; expected e.g. "
        f'[dependency-groups] test = ["{TEST_RUNNER}>=9"] (its tests run in an environment holding only it)'
    )


def sync_command(package: Package) -> list[str]:
    # uv installs only the default groups ("dev") unless told: each of the package's groups is named.
    # No bytecode compilation here: compiling all 14k files of the stack takes 20-50 s per environment
    # on two cores, while a package's tests import a few of them.
    groups = [arg for group in package.groups for arg in ("--group", group)]
    return ["uv", "sync", "--locked", "--package", package.name, "--no-compile-bytecode", *groups]


def sync(package: Package, env_dir: Path) -> tuple[int, str]:
    """Exact sync of env_dir to the lock for this package; prints uv's summary (all of it on failure)."""
    status, output = stream(sync_command(package), uv_environ(env_dir), echo=False)
    # uv lists every package it adds or removes; keep its summary lines.
    for line in output.splitlines():
        if status != 0 or not line.startswith((" + ", " - ", " ~ ")):
            emit(f"  {line}\n")
    return status, output
