"""The launcher's side of the end-of-run summary (``train.summary``): a file for rank 0, printed at the end.

The ranks' last lines are torchtitan's own (closing the checkpointer, destroying the process group), so
rank 0 hands the summary to the launcher in a file, and the launcher prints it after torchrun returns, as
the run's last lines, with what only the launcher knows: the command the user typed and the wall time.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from qwen3_titan_common.cli.dispatch import uv_parent_command
from qwen3_titan_common.train.summary import SUMMARY_FILE_ENV, RunSummary, summary_lines


def user_command(argv: list[str]) -> list[str]:
    """The command the user typed: ``uv run ... train ...`` as uv received it, else ``train ...``."""
    return uv_parent_command() or ["train", *argv]


@contextmanager
def summary_file() -> Iterator[dict[str, str]]:
    """The environment entry telling rank 0 where to write; the file is gone afterwards."""
    folder = tempfile.mkdtemp(prefix="qwen3-titan-summary-")
    try:
        yield {SUMMARY_FILE_ENV: str(Path(folder) / "summary.json")}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def print_summary(env: dict[str, str], argv: list[str], started: float) -> None:
    summary = RunSummary.read(env[SUMMARY_FILE_ENV])
    if summary is None:  # another node's launcher, or a run that ended before its summary
        return
    command = user_command(argv)
    python = ["uv", "run", "python"] if command[0] == "uv" else [sys.executable]
    for line in summary_lines(
        summary, command=command, python=python, wall_seconds=time.monotonic() - started
    ):
        print(f"[train] {line}", flush=True)
