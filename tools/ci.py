"""Per-package CI: every workspace package installs and tests on its own, then the workspace as a whole.

Run from anywhere in the repository::

    uv run python tools/ci.py                          # every package, then root tests/ and ruff
    uv run --no-project python tools/ci.py --package native-backend   # one package (its GitHub job)
    uv run python tools/ci.py --root-only              # root tests/ and ruff only (the workspace job)
    uv run python tools/ci.py --skip-root -m "not slow"    # -k/-m, and anything after --, go to pytest
    uv run python tools/ci.py --self-check             # drops a dependency in a scratch copy; shows the failure
    uv run python tools/ci.py --write-workflows        # (re)writes .github/workflows/ from packages/*

Each ``packages/*/pyproject.toml`` is one package (found afresh on every run). For each:

1. ``UV_PROJECT_ENVIRONMENT=.ci-envs/<name> uv sync --locked --package <name>``: the package and what it
   declares (its own dependency groups included), at the versions in uv.lock, and nothing else; exact,
   so what an earlier run installed and the lock no longer needs is removed. The folder is reused between
   runs; uv hardlinks files from its cache, so an environment costs seconds, not a download.
2. pytest at the lock's version: ``uv pip install pytest`` constrained by ``uv export`` of the lock.
3. An import check: every module under the package's ``src/`` is imported in that environment.
4. ``pytest packages/<name>/tests`` there, with the root pyproject's pytest config (markers, ``-ra``)
   and ``--strict-markers``.

Then the workspace environment (``uv run --locked --all-packages``): root ``tests/`` (and the GPU
benchmark's CPU-side checks, ``tools/gpu_bench/test_gpu_bench.py``), ``ruff check``,
``ruff format --check``. The closing line sums pytest's counts plus one check per import check and
ruff command: ``N passed, N failed, N skipped``; the exit status is 1 when anything failed.
Standard library only: the package jobs run it with ``uv run --no-project``, without the workspace.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    sys.exit(f"tools/ci.py: needs Python 3.11+ (tomllib); this is {sys.version.split()[0]}")

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / ".ci-envs"
WORKFLOWS = ROOT / ".github" / "workflows"
CORE = "common"
DEFAULT_SELF_CHECK = "native-backend:common"
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return normalize(found.group(1)) if found else ""


@dataclass(frozen=True)
class Package:
    name: str
    folder: Path
    dependencies: tuple[str, ...]  # normalized names from [project].dependencies
    groups: tuple[str, ...]  # its own [dependency-groups]: test-only dependencies, installed too

    @property
    def rel(self) -> str:
        return self.folder.relative_to(ROOT).as_posix()

    @property
    def modules(self) -> list[str]:
        """Top-level import names shipped from src/."""
        src = self.folder / "src"
        if not src.is_dir():
            return []
        names = {p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
        names = {n for n in names if not n.endswith((".egg-info", ".dist-info"))}
        names |= {p.stem for p in src.glob("*.py")}
        return sorted(names)


def discover(root: Path = ROOT) -> dict[str, Package]:
    packages = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        name = normalize(data["project"]["name"])
        deps = tuple(requirement_name(r) for r in data["project"].get("dependencies", []))
        groups = tuple(data.get("dependency-groups", {}))
        packages[name] = Package(name=name, folder=pyproject.parent, dependencies=deps, groups=groups)
    return packages


def workspace_closure(package: Package, packages: dict[str, Package]) -> list[Package]:
    """The workspace packages this one depends on, directly or not."""
    seen: dict[str, Package] = {}
    todo = [d for d in package.dependencies if d in packages]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen[name] = packages[name]
            todo += [d for d in packages[name].dependencies if d in packages]
    return sorted(seen.values(), key=lambda p: p.name)


@dataclass
class Result:
    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    missing: set[str] = field(default_factory=set)

    def line(self) -> str:
        status = "FAILED" if self.failed else "ok"
        counts = f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"
        notes = list(self.notes)
        if self.missing:
            notes.append("missing modules: " + ", ".join(sorted(self.missing)))
        return f"{self.name:<18} {status:<6} {counts} in {self.seconds:.1f} s" + (
            f"  ({'; '.join(notes)})" if notes else ""
        )


def say(message: str) -> None:
    print(f"ci: {message}", flush=True)


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
            sys.stdout.write(line)
            sys.stdout.flush()
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


def pytest_command(
    python: list[str], target: str | tuple[str, ...], junit: Path, pytest_args: list[str]
) -> list[str]:
    # -c/--rootdir: the root pyproject's config (markers, -ra, import mode) whichever folder is tested.
    targets = (target,) if isinstance(target, str) else target
    return [
        *python, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
        "--strict-markers", f"--junitxml={junit}", *targets, *pytest_args,
    ]  # fmt: skip


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


# A module that raises ImportError itself (not ModuleNotFoundError) says it is unavailable on this
# platform, e.g. NKI kernels that need the Neuron SDK: listed, not failed. Anything else fails.
IMPORT_CHECK = r"""
import importlib, pkgutil, sys
imported, unavailable, failed = 0, 0, 0
def attempt(name):
    global imported, unavailable, failed
    try:
        module = importlib.import_module(name)
    except Exception as err:
        if type(err) is ImportError:
            unavailable += 1
            print(f"import check: {name}: unavailable here: {err}", flush=True)
        else:
            failed += 1
            print(f"import check FAILED: {name}: {type(err).__name__}: {err}", flush=True)
        return None
    imported += 1
    return module
for top in sys.argv[1:]:
    module = attempt(top)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), top + ".", onerror=lambda n: None):
        attempt(info.name)
print(f"import check: {imported} modules imported, {unavailable} unavailable here, {failed} failed", flush=True)
sys.exit(1 if failed else 0)
"""


class Constraints:
    """uv.lock's pins as a constraints file, so pytest joins a package environment at its locked version."""

    def __init__(self, envs: Path):
        self.path = envs / "constraints.txt"
        self.ready = False

    def get(self) -> tuple[int, str]:
        """Exit status and output of the export (0 and '' once it has been written)."""
        if self.ready:
            return 0, ""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            "uv", "export", "--locked", "--all-packages", "--all-groups", "--no-hashes", "--no-header",
            "--no-annotate", "--no-emit-workspace", "--format", "requirements.txt", "--quiet",
            "-o", str(self.path),
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        self.ready = proc.returncode == 0
        return proc.returncode, proc.stdout + proc.stderr


def run_package(package: Package, envs: Path, constraints: Constraints, pytest_args: list[str]) -> Result:
    result = Result(package.name)
    start = time.monotonic()
    env_dir = envs / package.name
    say(
        f"{package.name}: environment {env_dir.relative_to(ROOT) if env_dir.is_relative_to(ROOT) else env_dir}"
    )

    # No bytecode compilation here (the workspace's compile-bytecode is for a user's first `train`):
    # compiling all 14k files of the stack takes 20-50 s per environment on two cores, while the
    # tests compile the few they import once, into the reused environment.
    groups = [arg for group in package.groups for arg in ("--group", group)]
    sync = ["uv", "sync", "--locked", "--package", package.name, "--no-compile-bytecode", *groups]
    status, output = stream(sync, uv_environ(env_dir), echo=False)
    # uv lists every package it adds or removes; keep its summary lines, all of it on failure.
    for line in output.splitlines():
        if status != 0 or not line.startswith((" + ", " - ", " ~ ")):
            print(f"  {line}", flush=True)
    if status == 0:
        status, output = constraints.get()
    if status == 0:
        install = [
            "uv", "pip", "install", "--python", str(bin_dir(env_dir) / "python"), "--quiet",
            "-c", str(constraints.path), "pytest",
        ]  # fmt: skip
        status, output = stream(install, uv_environ(env_dir))
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
        # -I: no current folder on sys.path, so only what is installed can be imported.
        status, output = stream([python, "-I", "-c", IMPORT_CHECK, *package.modules], environ)
        unavailable = re.search(r"(\d+) unavailable here", output)
        if unavailable and unavailable.group(1) != "0":
            result.notes.append(f"{unavailable.group(1)} modules unavailable on this platform")
        if status == 0:
            result.passed += 1
        else:
            result.failed += 1
            result.notes.append("import check failed")
            result.missing |= set(MISSING_MODULE.findall(output))

    tests = package.folder / "tests"
    if not tests.is_dir():
        result.notes.append("no tests/ folder")
    else:
        junit = env_dir / "junit.xml"
        junit.unlink(missing_ok=True)
        cmd = pytest_command([python], tests.relative_to(ROOT).as_posix(), junit, pytest_args)
        status, output = stream(cmd, environ)
        count_pytest(result, status, output, junit)
    result.seconds = time.monotonic() - start
    return result


# Cross-package tests, and the GPU benchmark's logic checks (they need no GPU).
WORKSPACE_TEST_PATHS = ("tests", "tools/gpu_bench/test_gpu_bench.py")


def run_workspace(envs: Path, pytest_args: list[str], lint: bool) -> list[Result]:
    """Root tests/ and ruff, in the workspace environment with every package installed."""
    uv_run = ["uv", "run", "--locked", "--all-packages"]
    environ = dict(os.environ)
    results = []

    result = Result("workspace tests/")
    start = time.monotonic()
    targets = tuple(path for path in WORKSPACE_TEST_PATHS if (ROOT / path).exists())
    say(
        f"workspace: {' '.join(targets) or 'no tests'} in the workspace environment (uv run --locked --all-packages)"
    )
    if targets:
        junit = envs / "junit-workspace.xml"
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.unlink(missing_ok=True)
        status, output = stream(pytest_command([*uv_run, "python"], targets, junit, pytest_args), environ)
        count_pytest(result, status, output, junit)
    else:
        result.notes.append("no tests/ folder")
    result.seconds = time.monotonic() - start
    results.append(result)

    if lint:
        result = Result("lint")
        start = time.monotonic()
        for cmd in (["ruff", "check"], ["ruff", "format", "--check"]):
            say("lint: " + " ".join(cmd))
            status, _ = stream([*uv_run, *cmd], environ)
            if status == 0:
                result.passed += 1
            else:
                result.failed += 1
                result.notes.append(" ".join(cmd) + " failed")
        result.seconds = time.monotonic() - start
        results.append(result)
    return results


def summarize(results: list[Result], seconds: float) -> int:
    print(flush=True)
    say(f"summary ({seconds:.0f} s)")
    for result in results:
        print(result.line(), flush=True)
    passed = sum(r.passed for r in results)
    failed = sum(r.failed for r in results)
    skipped = sum(r.skipped for r in results)
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    return 1 if failed else 0


# --self-check: a dependency line dropped in a scratch copy must fail that package, naming the import.


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


def locked_closure(lock_path: Path, package: str) -> set[str]:
    by_name = {normalize(p["name"]): p for p in tomllib.loads(lock_path.read_text())["package"]}
    seen, todo = set(), [package]
    while todo:
        name = todo.pop()
        for dep in by_name.get(name, {}).get("dependencies", []):
            if normalize(dep["name"]) not in seen:
                seen.add(normalize(dep["name"]))
                todo.append(normalize(dep["name"]))
    return seen


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

    # 2. The package's real isolated run, on the scratch tree.
    still_installed = normalize(dependency) in locked_closure(scratch / "uv.lock", package)
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    cmd = [sys.executable, str(scratch / "tools" / "ci.py"), "--package", package, "--", "-x"]
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


# --write-workflows: one GitHub Actions workflow per package, with its own paths filter.

GENERATED = "# Generated by `uv run python tools/ci.py --write-workflows`: edit tools/ci.py, not this file.\n"
SETUP = """\
      - uses: actions/checkout@v5
      - uses: astral-sh/setup-uv@v7
        with:
          enable-cache: true
"""


def package_workflow(package: Package, packages: dict[str, Package]) -> str:
    paths = [f"{package.rel}/**", *(f"{dep.rel}/**" for dep in workspace_closure(package, packages))]
    paths += ["pyproject.toml", "uv.lock", "tools/ci.py", f".github/workflows/package-{package.name}.yml"]
    filters = "".join(f'      - "{p}"\n' for p in paths)
    return (
        GENERATED
        + f"name: {package.name}\n\n"
        + "on:\n"
        + f"  push:\n    branches: [main]\n    paths:\n{filters}"
        + f"  pull_request:\n    paths:\n{filters}"
        + "  workflow_dispatch:\n\n"
        + "jobs:\n"
        + "  test:\n"
        + f"    name: {package.name} in its own environment\n"
        + "    runs-on: ubuntu-latest\n"
        + "    timeout-minutes: 60\n"
        + "    steps:\n"
        + SETUP
        + f"      - run: uv run --no-project python tools/ci.py --package {package.name}\n"
    )


def workspace_workflow() -> str:
    return (
        GENERATED
        + "name: workspace\n\n"
        + "on:\n  push:\n    branches: [main]\n  pull_request:\n  workflow_dispatch:\n\n"
        + "jobs:\n"
        + "  test:\n"
        + "    name: root tests and lint\n"
        + "    runs-on: ubuntu-latest\n"
        + "    timeout-minutes: 60\n"
        + "    steps:\n"
        + SETUP
        + "      - run: uv sync --locked --all-packages\n"
        + "      - run: uv run --locked python tools/ci.py --root-only\n"
    )


def expected_workflows(packages: dict[str, Package]) -> dict[Path, str]:
    files = {WORKFLOWS / "workspace.yml": workspace_workflow()}
    for package in packages.values():
        files[WORKFLOWS / f"package-{package.name}.yml"] = package_workflow(package, packages)
    return files


def write_workflows() -> int:
    expected = expected_workflows(discover())
    WORKFLOWS.mkdir(parents=True, exist_ok=True)
    for path in sorted(WORKFLOWS.glob("*.yml")):
        if path not in expected and path.read_text().startswith(GENERATED):
            path.unlink()
            say(f"removed {path.relative_to(ROOT)} (no such package)")
    for path, text in expected.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            say(f"wrote {path.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="tools/ci.py",
        description="Per-package CI: each package in its own environment, then the workspace.",
    )
    parser.add_argument(
        "--package", action="append", metavar="NAME", help="only this package (repeatable); no root step"
    )
    parser.add_argument("--skip-root", action="store_true", help="packages only: no root tests/, no lint")
    parser.add_argument("--root-only", action="store_true", help="root tests/ and lint only")
    parser.add_argument("--no-lint", action="store_true", help="skip ruff check / ruff format --check")
    parser.add_argument("-k", metavar="EXPR", help="passed to pytest")
    parser.add_argument("-m", metavar="MARKEXPR", help="passed to pytest")
    parser.add_argument(
        "--self-check", nargs="?", const=DEFAULT_SELF_CHECK, metavar="PACKAGE:DEPENDENCY",
        help=f"drop DEPENDENCY from PACKAGE in a scratch copy and check that CI names it (default {DEFAULT_SELF_CHECK})",
    )  # fmt: skip
    parser.add_argument("--write-workflows", action="store_true", help="(re)write .github/workflows/")
    args = parser.parse_args(argv)
    if shutil.which("uv") is None:
        parser.error("uv is not on PATH: `pip install uv`")
    if args.write_workflows:
        return write_workflows()
    if args.self_check:
        return self_check(args.self_check)

    pytest_args = [*(["-k", args.k] if args.k else []), *(["-m", args.m] if args.m else []), *passthrough]
    packages = discover()
    if args.package:
        unknown = sorted({normalize(n) for n in args.package} - set(packages))
        if unknown:
            parser.error(
                f"--package {', '.join(unknown)}: not in packages/*/pyproject.toml ({', '.join(packages)})"
            )
        selected = [packages[normalize(n)] for n in args.package]
    else:
        selected = [] if args.root_only else list(packages.values())
    run_root = not (args.package or args.skip_root)

    start = time.monotonic()
    say(
        f"packages: {', '.join(p.name for p in selected) or 'none'}; root tests/ and lint: {'yes' if run_root else 'no'}"
    )
    constraints = Constraints(ENVS)
    results = [run_package(p, ENVS, constraints, pytest_args) for p in selected]
    if run_root:
        results += run_workspace(ENVS, pytest_args, lint=not args.no_lint)
    return summarize(results, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
