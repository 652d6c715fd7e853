"""One package's step: its own environment, the import check, its tests."""

from __future__ import annotations

import re
import time
from pathlib import Path

from tools.ci import environment
from tools.ci.packages import ROOT, Package
from tools.ci.process import bin_dir, isolated_environ, say, stream
from tools.ci.pytest_run import MISSING_MODULE, count_pytest, pytest_command
from tools.ci.results import Result

IMPORT_PROBE = Path(__file__).with_name("import_probe.py")


def check_imports(python: str, package: Package, environ: dict[str, str], result: Result) -> None:
    # -I: neither the current folder nor the probe's own folder on sys.path: only what is installed imports.
    status, output = stream([python, "-I", str(IMPORT_PROBE), *package.modules], environ)
    unavailable = re.search(r"(\d+) unavailable here", output)
    if unavailable and unavailable.group(1) != "0":
        result.notes.append(f"{unavailable.group(1)} modules unavailable on this platform")
    if status == 0:
        result.passed += 1
    else:
        result.failed += 1
        result.notes.append("import check failed")
        result.missing |= set(MISSING_MODULE.findall(output))


def run_package(package: Package, envs: Path, pytest_args: list[str]) -> Result:
    result = Result(package.name)
    start = time.monotonic()
    env_dir = envs / package.name
    say(
        f"{package.name}: environment {env_dir.relative_to(ROOT) if env_dir.is_relative_to(ROOT) else env_dir}"
    )
    status, output = environment.sync(package, env_dir)
    env_seconds = time.monotonic() - start
    if status != 0:
        result.failed += 1
        result.notes.append("environment failed: " + (output.strip().splitlines() or ["?"])[-1].strip())
        result.seconds = env_seconds
        return result
    result.notes.append(f"environment {env_seconds:.1f} s")

    python = str(bin_dir(env_dir) / "python")
    environ = isolated_environ(env_dir)
    if package.modules:
        check_imports(python, package, environ, result)

    tests = package.folder / "tests"
    if not tests.is_dir():
        result.notes.append("no tests/ folder")
    elif problem := environment.missing_test_runner(package):
        say(problem)
        result.failed += 1
        result.notes.append(problem)
    else:
        junit = env_dir / "junit.xml"
        junit.unlink(missing_ok=True)
        cmd = pytest_command([python], tests.relative_to(ROOT).as_posix(), junit, pytest_args)
        status, output = stream(cmd, environ)
        count_pytest(result, status, output, junit)
    result.seconds = time.monotonic() - start
    return result
