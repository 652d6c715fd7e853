"""The launcher stays torchrun plus the user's first and last lines: its code and the
environment variables it shares with the ranks are counted here, so growth is a decision, not a drift."""

from __future__ import annotations

import re
from pathlib import Path

COMMON = Path(__file__).resolve().parents[1] / "packages" / "common" / "src" / "qwen3_titan_common"
SOURCES = Path(__file__).resolve().parents[1] / "packages"
# --check-layout's flag and runner are in it; its work is train.layout_check's.
MAX_LAUNCHER_LINES = 2015
# The device, the backend, tracebacks shown live, and the command as typed (for the model cards).
PRODUCT_VARIABLES = {
    "QWEN3_TITAN_DEVICE",
    "QWEN3_TITAN_BACKEND",
    "QWEN3_TITAN_SHOW_TRACEBACK",
    "QWEN3_TITAN_COMMAND",
}


def test_cli_and_runtime_fit_the_budget():
    files = [*COMMON.glob("cli/*.py"), *COMMON.glob("runtime/*.py")]
    lines = sum(len(path.read_text().splitlines()) for path in files)
    assert lines <= MAX_LAUNCHER_LINES, f"cli/ + runtime/: {lines} lines, over {MAX_LAUNCHER_LINES}"


def test_the_product_reads_only_its_four_variables():
    found = set()
    for path in SOURCES.glob("*/src/**/*.py"):
        if "qwen3_titan_testing" in path.parts:
            continue  # the tests' own markers
        found |= set(re.findall(r"QWEN3_TITAN_[A-Z_]+", path.read_text()))
    assert found == PRODUCT_VARIABLES


def test_few_fragment_modules():
    """One concern per module, not one function per file: few modules under 40 lines (``__init__`` aside)."""
    small = sorted(
        str(path.relative_to(SOURCES))
        for path in SOURCES.glob("*/src/**/*.py")
        if path.name != "__init__.py" and len(path.read_text().splitlines()) < 40
    )
    assert len(small) <= 6, small
