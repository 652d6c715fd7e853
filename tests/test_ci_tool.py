"""tools/ci.py: its counting, its GitHub workflows, and (slow) the proof that a dropped dependency fails."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_ci():
    spec = importlib.util.spec_from_file_location("qwen3_titan_ci_tool", ROOT / "tools" / "ci.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


ci = _load_ci()


def test_workflows_are_current():
    stale = []
    for path, text in ci.expected_workflows(ci.discover()).items():
        if not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(ROOT)))
    assert not stale, (
        f"{', '.join(stale)}: missing or out of date for packages/*/pyproject.toml; "
        f"run `uv run python tools/ci.py --write-workflows`"
    )


def test_backend_workflows_also_trigger_on_common():
    packages = ci.discover()
    for package in packages.values():
        text = ci.package_workflow(package, packages)
        assert f'"{package.rel}/**"' in text
        assert f"tools/ci.py --package {package.name}\n" in text
        if ci.CORE in package.dependencies:
            assert f'"packages/{ci.CORE}/**"' in text, package.name


def test_every_run_uses_the_root_pytest_config_with_strict_markers(tmp_path):
    cmd = ci.pytest_command(["python"], "packages/x/tests", tmp_path / "j.xml", ["-k", "fast"])
    assert cmd[cmd.index("-c") + 1] == str(ROOT / "pyproject.toml")
    assert cmd[cmd.index("--rootdir") + 1] == str(ROOT)
    assert "--strict-markers" in cmd and cmd[-3:] == ["packages/x/tests", "-k", "fast"]


def _junit(tmp_path, tests, failures=0, errors=0, skipped=0):
    path = tmp_path / "junit.xml"
    path.write_text(
        f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" errors="{errors}" '
        f'skipped="{skipped}"/></testsuites>'
    )
    return path


def test_counts_come_from_junit_and_errors_count_as_failed(tmp_path):
    result = ci.Result("x")
    ci.count_pytest(
        result,
        1,
        "E   ModuleNotFoundError: No module named 'qwen3_titan_common'",
        _junit(tmp_path, 10, 2, 1, 3),
    )
    assert (result.passed, result.failed, result.skipped) == (4, 3, 3)
    assert result.missing == {"qwen3_titan_common"}


def test_no_tests_collected_is_not_a_failure(tmp_path):
    result = ci.Result("x")
    ci.count_pytest(result, 5, "", _junit(tmp_path, 0))
    assert (result.passed, result.failed, result.skipped) == (0, 0, 0)
    assert "no tests collected" in result.line() and "ok" in result.line()


def test_a_pytest_error_without_a_report_is_one_failure(tmp_path):
    result = ci.Result("x")
    ci.count_pytest(result, 4, "ERROR: usage", tmp_path / "absent.xml")
    assert result.failed == 1 and "pytest exited 4" in result.line()


def test_closing_line_sums_everything(capsys):
    results = [
        ci.Result("a", passed=3, skipped=1, seconds=1.0),
        ci.Result("b", passed=2, failed=1, seconds=2.0),
    ]
    assert ci.summarize(results, 3.0) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "5 passed, 1 failed, 1 skipped"
    assert lines[-3].startswith("a ") and "3 passed, 0 failed, 1 skipped in 1.0 s" in lines[-3]
    assert "FAILED" in lines[-2]
    assert ci.summarize([ci.Result("a", passed=1)], 1.0) == 0


def test_drop_dependency_removes_only_that_line(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = [\n    "common",\n    "torch==2.14.*",\n]\n\n'
        "[tool.uv.sources]\ncommon = { workspace = true }\n"
    )
    ci.drop_dependency(pyproject, "common")
    assert pyproject.read_text() == (
        '[project]\nname = "x"\ndependencies = [\n    "torch==2.14.*",\n]\n\n[tool.uv.sources]\ncommon = { workspace = true }\n'
    )
    with pytest.raises(SystemExit, match="no line declaring 'numpy'"):
        ci.drop_dependency(pyproject, "numpy")


@pytest.mark.slow
def test_self_check_a_dropped_dependency_fails_its_package_and_names_the_import():
    # Copies the tree, drops native-backend's "common", relocks; the static check and the package's own
    # isolated run must both fail naming it. Tens of seconds: one more environment, hardlinked from uv's cache.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "ci.py"), "--self-check"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert 'static check failed as expected: add "common" to its [project].dependencies' in out
    assert "isolated run failed as expected, missing modules: " in out and "qwen3_titan_common" in out
