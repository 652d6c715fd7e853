"""pytest's command line (the root pyproject's config, whichever folder is tested) and its counts."""

from __future__ import annotations

import re
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

from tools.ci.packages import ROOT
from tools.ci.results import Result

CONFIG = ROOT / "pyproject.toml"
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def pytest_command(
    python: list[str], target: str | tuple[str, ...], junit: Path, pytest_args: list[str]
) -> list[str]:
    # -c/--rootdir: the root pyproject's config (markers, strict_markers, -ra, import mode) whichever
    # folder is tested, so a package's run and a plain `uv run pytest` judge markers alike.
    # --durations: the slowest tests of each step in the log, for keeping the whole run under its budget.
    targets = (target,) if isinstance(target, str) else target
    return [
        *python, "-m", "pytest", "-c", str(CONFIG), "--rootdir", str(ROOT),
        f"--junitxml={junit}", "--durations=15", *targets, *pytest_args,
    ]  # fmt: skip


def workspace_test_paths(config: Path = CONFIG) -> tuple[str, ...]:
    """The root config's ``testpaths`` outside ``packages/`` (each package's tests run in its own step)."""
    options = tomllib.loads(config.read_text()).get("tool", {}).get("pytest", {}).get("ini_options", {})
    paths = [p.rstrip("/") for p in options.get("testpaths", [])]
    return tuple(p for p in paths if p != "packages" and not p.startswith("packages/"))


def count_pytest(result: Result, status: int, output: str, junit: Path) -> None:
    """Adds pytest's counts to result; exit 5 (nothing collected) is noted, not failed."""
    tests = failures = skipped = 0
    try:
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            tests += int(suite.get("tests", 0))
            failures += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skipped += int(suite.get("skipped", 0))
    except (OSError, ET.ParseError):
        pass
    if status == 5:
        result.notes.append("no tests collected")
        return
    result.passed += max(tests - failures - skipped, 0)
    if status != 0 and failures == 0:
        failures = 1  # usage error, interrupted run, internal error: one failure, named in the notes
        result.notes.append(f"pytest exited {status}")
    result.failed += failures
    result.skipped += skipped
    result.missing |= set(MISSING_MODULE.findall(output))
