"""The workspace steps, with every package installed: the root config's other testpaths, and ruff."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tools.ci.packages import ROOT
from tools.ci.process import say, stream
from tools.ci.pytest_run import count_pytest, pytest_command, workspace_test_paths
from tools.ci.results import Result

UV_RUN = ["uv", "run", "--locked", "--all-packages"]
LINT = (["ruff", "check"], ["ruff", "format", "--check"])


def run_tests(envs: Path, pytest_args: list[str]) -> Result:
    result = Result("workspace tests/")
    start = time.monotonic()
    targets = tuple(path for path in workspace_test_paths() if (ROOT / path).exists())
    say(
        f"workspace: {' '.join(targets) or 'no tests'} in the workspace environment (uv run --locked --all-packages)"
    )
    if targets:
        junit = envs / "junit-workspace.xml"
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.unlink(missing_ok=True)
        status, output = stream(
            pytest_command([*UV_RUN, "python"], targets, junit, pytest_args), dict(os.environ)
        )
        count_pytest(result, status, output, junit)
    else:
        result.notes.append("no tests/ folder")
    result.seconds = time.monotonic() - start
    return result


def run_lint() -> Result:
    result = Result("lint")
    start = time.monotonic()
    for cmd in LINT:
        say("lint: " + " ".join(cmd))
        status, _ = stream([*UV_RUN, *cmd], dict(os.environ))
        if status == 0:
            result.passed += 1
        else:
            result.failed += 1
            result.notes.append(" ".join(cmd) + " failed")
    result.seconds = time.monotonic() - start
    return result
