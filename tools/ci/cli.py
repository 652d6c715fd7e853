"""The command line: which steps run, with which pytest arguments; the closing summary's exit status."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tools.ci.environment import ENVS
from tools.ci.lanes import Step, default_lanes, lane_threads, measured_seconds, run_steps, slow_weight
from tools.ci.package_run import run_package
from tools.ci.packages import ROOT, Package, discover, normalize
from tools.ci.process import say
from tools.ci.pytest_run import workspace_test_paths
from tools.ci.results import summarize
from tools.ci.self_check import DEFAULT as DEFAULT_SELF_CHECK
from tools.ci.self_check import self_check
from tools.ci.workflows import write_workflows
from tools.ci.workspace_run import run_lint, run_tests


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.ci",
        description="Per-package CI: each package in its own environment, and the workspace, two steps at a time.",
    )
    p.add_argument(
        "--package", action="append", metavar="NAME", help="only this package (repeatable); no root step"
    )
    p.add_argument("--skip-root", action="store_true", help="packages only: no root tests, no lint")
    p.add_argument("--root-only", action="store_true", help="root tests and lint only")
    p.add_argument("--no-lint", action="store_true", help="skip ruff check / ruff format --check")
    p.add_argument(
        "-j", "--jobs", type=int, default=default_lanes(), metavar="N",
        help="steps run side by side, heaviest first (default %(default)s: this machine's cores, at most 2)",
    )  # fmt: skip
    p.add_argument("-k", metavar="EXPR", help="passed to pytest")
    p.add_argument("-m", metavar="MARKEXPR", help="passed to pytest")
    p.add_argument(
        "--self-check", nargs="?", const=DEFAULT_SELF_CHECK, metavar="PACKAGE:DEPENDENCY",
        help=f"drop DEPENDENCY from PACKAGE in a scratch copy and check that CI names it (default {DEFAULT_SELF_CHECK})",
    )  # fmt: skip
    p.add_argument("--write-workflows", action="store_true", help="(re)write .github/workflows/")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    cli = parser()
    args = cli.parse_args(argv)
    if args.jobs < 1:
        cli.error(f"--jobs {args.jobs}: expected at least 1 (steps run side by side)")
    if shutil.which("uv") is None:
        cli.error("uv is not on PATH: `pip install uv`")
    if args.write_workflows:
        return write_workflows()
    if args.self_check:
        return self_check(args.self_check)

    pytest_args = [*(["-k", args.k] if args.k else []), *(["-m", args.m] if args.m else []), *passthrough]
    packages = discover()
    if args.package:
        unknown = sorted({normalize(n) for n in args.package} - set(packages))
        if unknown:
            cli.error(
                f"--package {', '.join(unknown)}: not in packages/*/pyproject.toml ({', '.join(packages)})"
            )
        selected = [packages[normalize(n)] for n in args.package]
    else:
        selected = [] if args.root_only else list(packages.values())
    run_root = not (args.package or args.skip_root)

    start = time.monotonic()
    os.environ.update(lane_threads(args.jobs, dict(os.environ)))
    say(
        f"packages: {', '.join(p.name for p in selected) or 'none'}; root tests and lint: {'yes' if run_root else 'no'}; "
        f"{args.jobs} at a time, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )
    steps = [package_step(p, pytest_args) for p in selected]
    if run_root:
        steps.append(
            Step(
                "workspace tests/",
                lambda: [run_tests(ENVS, pytest_args)],
                slow_weight([ROOT / path for path in workspace_test_paths()]),
            )
        )
        if not args.no_lint:
            # Seconds long: last, on whichever lane is free first.
            steps.append(Step("lint", lambda: [run_lint()], weight=-1))
    results = run_steps(steps, args.jobs, measured_seconds())
    record_seconds(results, ENVS / "durations.json")
    return summarize(results, time.monotonic() - start)


def record_seconds(results, path: Path) -> None:
    """This run's seconds per step, in the form of ``tools/ci/durations.json`` (which a clean-clone run's
    copy replaces when the suite's balance has moved)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({r.name: round(r.seconds, 1) for r in results}, indent=2) + "\n")


def package_step(package: Package, pytest_args: list[str]) -> Step:
    return Step(
        package.name,
        lambda: [run_package(package, ENVS, pytest_args)],
        slow_weight([package.folder / "tests"]),
    )
