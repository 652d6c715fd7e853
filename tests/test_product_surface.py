"""What the product reads from the environment (three variables: the rest reaches a rank in its config), and
modules sized to a concern rather than to one function."""

from __future__ import annotations

import re
from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / "packages"
# The device, the backend, and tracebacks shown live: a user's switches, for the launcher and a bare torchrun alike.
PRODUCT_VARIABLES = {
    "QWEN3_TITAN_DEVICE",
    "QWEN3_TITAN_BACKEND",
    "QWEN3_TITAN_SHOW_TRACEBACK",
}


def test_the_product_reads_only_its_three_variables():
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
