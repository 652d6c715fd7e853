"""``--self-check``: a dependency line dropped in a scratch copy must fail that package, naming the import."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from tools.ci.packages import ROOT, discover, locked_closure, normalize, requirement_name
from tools.ci.process import say, stream
from tools.ci.pytest_run import MISSING_MODULE

# nki-moe-backend's test group does not bring common back in (test-support would), so its isolated run
# really misses the dropped package.
DEFAULT = "nki-moe-backend:common"


def scratch_copy(dest: Path) -> None:
    """The working tree as a fresh clone would hold it (plus uncommitted work), without envs or outputs."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode().split("\0")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", ".ci-envs", "outputs", "__pycache__", ".pytest_cache", ".ruff_cache"}
        shutil.copytree(
            ROOT, dest, ignore=lambda _dir, names: [n for n in names if n in skip], dirs_exist_ok=True
        )
        return
    for rel in filter(None, listed):
        source = ROOT / rel
        if source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)


def drop_dependency(pyproject: Path, dependency: str) -> None:
    """Removes the one line declaring ``dependency`` from [project].dependencies, text otherwise untouched."""
    lines = pyproject.read_text().splitlines(keepends=True)
    kept, section, in_deps, dropped = [], "", False, False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("[") and not in_deps:
            section = stripped
        if section == "[project]" and re.match(r"dependencies\s*=\s*\[", stripped):
            in_deps = True
        elif in_deps and stripped.startswith("]"):
            in_deps = False
        elif in_deps and requirement_name(stripped.strip("\"',")) == normalize(dependency):
            dropped = True
            continue
        kept.append(line)
    if not dropped:
        raise SystemExit(
            f"--self-check: {pyproject}: no line declaring {dependency!r} in [project].dependencies"
        )
    pyproject.write_text("".join(kept))
    remaining = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
    assert normalize(dependency) not in {requirement_name(r) for r in remaining}


def self_check(spec: str) -> int:
    package, _, dependency = spec.partition(":")
    packages = discover()
    if package not in packages or not dependency:
        raise SystemExit(
            f"--self-check {spec}: expected PACKAGE:DEPENDENCY with PACKAGE one of {sorted(packages)}"
        )
    start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="ci-self-check-"))
    say(f"self-check: copy of the tree in {scratch}; dropping {dependency!r} from {package}'s dependencies")
    scratch_copy(scratch)
    drop_dependency(scratch / packages[package].rel / "pyproject.toml", dependency)
    relock = subprocess.run(["uv", "lock", "--offline", "--quiet"], cwd=scratch)
    if relock.returncode != 0:
        subprocess.run(["uv", "lock", "--quiet"], cwd=scratch, check=True)
    problems = []

    # 1. The static check, on the scratch tree, in the workspace environment of this tree.
    test = scratch / "tests" / "test_declared_dependencies.py"
    cmd = [
        "uv", "run", "--project", str(ROOT), "--locked", "--all-packages", "python", "-m", "pytest",
        "-c", str(scratch / "pyproject.toml"), "--rootdir", str(scratch), "-p", "no:cacheprovider", "-q",
        str(test), "-k", f"test_source_imports_are_declared and {package}",
    ]  # fmt: skip
    status, output = stream(cmd, {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}, cwd=scratch)
    expected = f'add "{normalize(dependency)}" to its [project].dependencies'
    if status != 1 or expected not in output:
        problems.append(f"static check: expected a failure saying '{expected}' (pytest exited {status})")
    else:
        say(f"self-check: static check failed as expected: {expected}")

    # 2. The package's real isolated run, on the scratch tree: `-m` from the scratch root imports its tools.
    still_installed = normalize(dependency) in locked_closure(scratch / "uv.lock", package)
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    cmd = [sys.executable, "-m", "tools.ci", "--package", package, "--", "-x"]
    status, output = stream(cmd, environ, cwd=scratch)
    missing = set(MISSING_MODULE.findall(output))
    dep_modules = set(packages[dependency].modules) if dependency in packages else None
    if still_installed:
        say(
            f"self-check: {dependency} is still installed through another dependency of {package}, so the "
            f"isolated run cannot miss it (exit {status}); the static check is what catches this case"
        )
    elif status == 0 or not missing or (dep_modules is not None and not missing & dep_modules):
        problems.append(
            f"isolated run: expected a failure naming a missing module of {dependency} "
            f"(exit {status}, missing modules: {sorted(missing) or 'none'})"
        )
    else:
        say(f"self-check: isolated run failed as expected, missing modules: {', '.join(sorted(missing))}")

    seconds = time.monotonic() - start
    if problems:
        for problem in problems:
            say(f"self-check FAILED: {problem}")
        say(f"self-check: scratch tree kept in {scratch}")
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    say(f"self-check passed in {seconds:.0f} s: dropping {dependency!r} from {package} fails its CI")
    return 0
