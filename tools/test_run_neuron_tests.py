"""tools/run_neuron_tests.py off Trainium and without the Neuron nki package: one line, exit 2.

uv run pytest tools/test_run_neuron_tests.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import run_neuron_tests

ROOT = Path(__file__).resolve().parents[1]


def _nki_simulator_installed() -> bool:
    return run_neuron_tests.nki_simulator_problem() is None


def test_simulate_without_nki_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "nki", None)  # what an absent package looks like to `import nki`
    problem = run_neuron_tests.nki_simulator_problem()
    assert problem is not None and problem.startswith("nki is not installed") and "\n" not in problem


@pytest.mark.skipif(
    _nki_simulator_installed(), reason="nki.simulate is installed: --simulate would run the suite"
)
def test_simulate_stops_with_one_line_here():
    proc = subprocess.run(
        [sys.executable, "tools/run_neuron_tests.py", "--simulate"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_neuron_tests --simulate: nki is not installed"), (
        proc.stderr
    )
    assert proc.stdout == ""  # no pytest run was started


def test_without_trainium_it_stops_with_one_line():
    proc = subprocess.run(
        [sys.executable, "tools/run_neuron_tests.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 2:
        pytest.skip("a Neuron device is present: the suite ran")
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_neuron_tests: no usable Neuron device"), proc.stderr
