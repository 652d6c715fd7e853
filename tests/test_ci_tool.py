"""tools.ci: its counting, its lanes, its GitHub workflows, the one pytest config, and (slow) the proof that a
dropped dependency fails."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from tools.ci import environment, lanes, packages, process, pytest_run, workflows
from tools.ci.results import Result, summarize
from tools.ci.self_check import drop_dependency

ROOT = Path(__file__).resolve().parents[1]


def test_workflows_are_current():
    stale = []
    for path, text in workflows.expected_workflows(packages.discover()).items():
        if not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(ROOT)))
    assert not stale, (
        f"{', '.join(stale)}: missing or out of date for packages/*/pyproject.toml; "
        f"run `uv run python -m tools.ci --write-workflows`"
    )


def test_backend_workflows_also_trigger_on_common():
    found = packages.discover()
    for package in found.values():
        text = workflows.package_workflow(package, found)
        assert f'"{package.rel}/**"' in text and '"tools/ci/**"' in text
        assert f"uv run --no-project python -m tools.ci --package {package.name}\n" in text
        if packages.CORE in package.dependencies:
            assert f'"packages/{packages.CORE}/**"' in text, package.name


def test_every_run_uses_the_root_pytest_config(tmp_path):
    cmd = pytest_run.pytest_command(["python"], "packages/x/tests", tmp_path / "j.xml", ["-k", "fast"])
    assert cmd[cmd.index("-c") + 1] == str(ROOT / "pyproject.toml")
    assert cmd[cmd.index("--rootdir") + 1] == str(ROOT)
    assert cmd[-3:] == ["packages/x/tests", "-k", "fast"]
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["strict_markers"] is True


def test_an_unregistered_marker_fails_under_the_root_config(tmp_path):
    # The config alone, no flag: what plain `uv run pytest` and every CI step get.
    (tmp_path / "test_marked.py").write_text("import pytest\n\n@pytest.mark.slwo\ndef test_x():\n    pass\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", str(tmp_path / "test_marked.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "'slwo' not found in `markers` configuration option" in proc.stdout


def test_workspace_step_runs_the_configured_testpaths_outside_packages():
    assert pytest_run.workspace_test_paths() == ("tests", "tools")
    config = ROOT / "pyproject.toml"
    assert (
        "packages/common/tests"
        in tomllib.loads(config.read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    )


def test_each_package_brings_its_own_pytest():
    # No separate install step: the package's environment gets pytest from its own dependency group.
    for package in packages.discover().values():
        assert environment.missing_test_runner(package) == "", package.name
        cmd = environment.sync_command(package)
        assert cmd[:5] == ["uv", "sync", "--locked", "--package", package.name]
        assert all(f"--group {g}" in " ".join(cmd) for g in package.groups) and package.groups


def test_a_package_without_pytest_in_its_groups_is_named(tmp_path):
    pyproject = tmp_path / "packages" / "x" / "pyproject.toml"
    pyproject.parent.mkdir(parents=True)
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = []\n\n[dependency-groups]\ntest = ["numpy"]\n'
    )
    (package,) = packages.discover(tmp_path).values()
    assert package.groups == ("test",) and package.group_requirements == ("numpy",)
    assert environment.missing_test_runner(package) == (
        f"{pyproject}: no dependency group lists pytest; expected e.g. "
        '[dependency-groups] test = ["pytest>=9"] (its tests run in an environment holding only it)'
    )


def _junit(tmp_path, tests, failures=0, errors=0, skipped=0):
    path = tmp_path / "junit.xml"
    path.write_text(
        f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" errors="{errors}" '
        f'skipped="{skipped}"/></testsuites>'
    )
    return path


def test_counts_come_from_junit_and_errors_count_as_failed(tmp_path):
    result = Result("x")
    pytest_run.count_pytest(
        result,
        1,
        "E   ModuleNotFoundError: No module named 'qwen3_titan_common'",
        _junit(tmp_path, 10, 2, 1, 3),
    )
    assert (result.passed, result.failed, result.skipped) == (4, 3, 3)
    assert result.missing == {"qwen3_titan_common"}


def test_no_tests_collected_is_not_a_failure(tmp_path):
    result = Result("x")
    pytest_run.count_pytest(result, 5, "", _junit(tmp_path, 0))
    assert (result.passed, result.failed, result.skipped) == (0, 0, 0)
    assert "no tests collected" in result.line() and "ok" in result.line()


def test_a_pytest_error_without_a_report_is_one_failure(tmp_path):
    result = Result("x")
    pytest_run.count_pytest(result, 4, "ERROR: usage", tmp_path / "absent.xml")
    assert result.failed == 1 and "pytest exited 4" in result.line()


def test_closing_line_sums_everything(capsys):
    results = [
        Result("a", passed=3, skipped=1, seconds=1.0),
        Result("b", passed=2, failed=1, seconds=2.0),
    ]
    assert summarize(results, 3.0) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "5 passed, 1 failed, 1 skipped"
    assert lines[-3].startswith("a ") and "3 passed, 0 failed, 1 skipped in 1.0 s" in lines[-3]
    assert "FAILED" in lines[-2]
    assert summarize([Result("a", passed=1)], 1.0) == 0


def test_drop_dependency_removes_only_that_line(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = [\n    "common",\n    "torch==2.14.*",\n]\n\n'
        "[tool.uv.sources]\ncommon = { workspace = true }\n"
    )
    drop_dependency(pyproject, "common")
    assert pyproject.read_text() == (
        '[project]\nname = "x"\ndependencies = [\n    "torch==2.14.*",\n]\n\n[tool.uv.sources]\ncommon = { workspace = true }\n'
    )
    with pytest.raises(SystemExit, match="no line declaring 'numpy'"):
        drop_dependency(pyproject, "numpy")


def test_the_command_line_runs_as_a_module_from_the_root():
    # What README, .ci/run and the workflows call; -h needs neither uv nor the network.
    proc = subprocess.run(
        [sys.executable, "-m", "tools.ci", "-h"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "--self-check" in proc.stdout and "--write-workflows" in proc.stdout


@pytest.mark.slow
def test_self_check_a_dropped_dependency_fails_its_package_and_names_the_import():
    # Copies the tree, drops nki-moe-backend's "common", relocks; the static check and the package's own
    # isolated run must both fail naming it. Tens of seconds: one more environment, hardlinked from uv's cache.
    proc = subprocess.run(
        [sys.executable, "-m", "tools.ci", "--self-check"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert 'static check failed as expected: add "common" to its [project].dependencies' in out
    assert "isolated run failed as expected, missing modules: " in out and "qwen3_titan_common" in out


def _child_printing(tag: str, lines: int) -> list[str]:
    # A real child process whose lines arrive one by one, as a pytest run's do.
    code = f"import time\nfor i in range({lines}):\n    print('{tag}', i, flush=True)\n    time.sleep(0.01)"
    return [sys.executable, "-c", code]


def test_two_lanes_run_steps_side_by_side_and_report_in_the_given_order():
    b_started = threading.Event()

    def a() -> list[Result]:
        # Returns only once b has started: with two lanes b runs meanwhile, one at a time it never would.
        return [Result("a", passed=int(b_started.wait(timeout=60)))]

    def b() -> list[Result]:
        b_started.set()
        return [Result("b", passed=1)]

    steps = [lanes.Step("b", b, weight=0), lanes.Step("a", a, weight=1)]
    results = lanes.run_steps(steps, lanes=2)
    assert [(r.name, r.passed) for r in results] == [("b", 1), ("a", 1)]


def test_one_lane_runs_the_heaviest_first_and_a_raising_step_is_one_failure():
    order = []

    def step(name: str):
        def run() -> list[Result]:
            order.append(name)
            if name == "broken":
                raise RuntimeError("no junit.xml")
            return [Result(name, passed=1)]

        return run

    steps = [lanes.Step("light", step("light"), 0), lanes.Step("broken", step("broken"), 5)]
    steps.append(lanes.Step("heavy", step("heavy"), 9))
    results = lanes.run_steps(steps, lanes=1)
    assert order == ["heavy", "broken", "light"]
    assert [r.name for r in results] == ["light", "broken", "heavy"]
    assert results[1].failed == 1 and results[1].notes == ["RuntimeError: no junit.xml"]


def test_a_step_beside_another_prints_its_output_as_one_block(capsys):
    def streaming(tag: str):
        def run() -> list[Result]:
            status, _ = process.stream(_child_printing(tag, 40), dict(os.environ))
            return [Result(tag, passed=int(status == 0))]

        return run

    results = lanes.run_steps(
        [lanes.Step("live", streaming("live"), 1), lanes.Step("aside", streaming("aside"), 0)], 2
    )
    assert [r.passed for r in results] == [1, 1]
    out = capsys.readouterr().out.splitlines()
    start = out.index("ci: ---- aside: output ----")
    end = out.index("ci: ---- aside: end of output ----")
    assert out[start + 1 : end] == [f"aside {i}" for i in range(40)]
    assert sorted(line for line in out if line.startswith("live ")) == sorted(f"live {i}" for i in range(40))


def test_lanes_share_the_cores_and_a_thread_count_the_caller_set_is_kept(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert lanes.lane_threads(2, {}) == {"OMP_NUM_THREADS": "1"}
    assert lanes.lane_threads(1, {}) == {"OMP_NUM_THREADS": "2"}
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert lanes.lane_threads(2, {}) == {"OMP_NUM_THREADS": "8"}
    assert lanes.lane_threads(3, {}) == {"OMP_NUM_THREADS": "5"}
    assert lanes.lane_threads(2, {"OMP_NUM_THREADS": "4"}) == {}
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert lanes.lane_threads(2, {}) == {"OMP_NUM_THREADS": "1"}


def test_slow_weight_counts_the_slow_marks_of_a_steps_tests(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_a.py").write_text(
        "@pytest.mark.slow\ndef test_x(): ...\n@pytest.mark.slow\ndef test_y(): ...\n"
    )
    (tmp_path / "tests/test_b.py").write_text("pytestmark = pytest.mark.slow\n")
    (tmp_path / "tests/helper.py").write_text("pytest.mark.slow\n")  # not a test file
    assert lanes.slow_weight([tmp_path / "tests", tmp_path / "absent"]) == 3


def test_jobs_below_one_is_refused_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "tools.ci", "--jobs", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith("--jobs 0: expected at least 1 (steps run side by side)")
    )


def test_measured_seconds_split_the_steps_so_the_longest_lane_is_as_short_as_it_can_be():
    seconds = {"a": 10.0, "b": 9.0, "c": 4.0, "d": 3.0, "e": 2.0}
    steps = [lanes.Step(name, lambda: [], weight=0) for name in seconds]
    planned = lanes.plan_lanes(steps, 2, seconds)
    loads = sorted(sum(seconds[step.name] for step in lane) for lane in planned)
    # One queue, heaviest first, ends at 15 (a, b; then c and d on the lanes that free first; then e).
    assert loads == [14.0, 14.0]
    assert sorted(step.name for lane in planned for step in lane) == sorted(seconds)
    for lane in planned:
        assert [seconds[step.name] for step in lane] == sorted(
            (seconds[step.name] for step in lane), reverse=True
        )
    # A step without a figure, or one lane: the queue.
    assert lanes.plan_lanes([*steps, lanes.Step("new", lambda: [], weight=0)], 2, seconds) is None
    assert lanes.plan_lanes(steps, 1, seconds) is None


def test_planned_lanes_run_their_own_steps_side_by_side(tmp_path):
    ran: dict[str, str] = {}

    def step(name: str):
        def run():
            ran[name] = threading.current_thread().name
            return [Result(name, passed=1)]

        return run

    seconds = {"long": 10.0, "short-1": 6.0, "short-2": 5.0}
    steps = [lanes.Step(name, step(name), weight=0) for name in seconds]
    results = lanes.run_steps(steps, lanes=2, seconds=seconds)
    assert [r.name for r in results] == list(seconds)
    assert ran["short-1"] == ran["short-2"] != ran["long"]


def test_the_committed_figures_cover_every_step_and_a_run_writes_them_back(tmp_path):
    from tools.ci.cli import record_seconds

    committed = lanes.measured_seconds()
    steps = {*packages.discover(), "workspace tests/", "lint"}
    assert steps <= set(committed), sorted(steps - set(committed))
    record_seconds([Result("common", seconds=12.34), Result("lint", seconds=0.3)], tmp_path / "d.json")
    assert lanes.measured_seconds(tmp_path / "d.json") == {"common": 12.3, "lint": 0.3}
    assert lanes.measured_seconds(tmp_path / "absent.json") == {}
