"""Which step checkpoint a run resumes from, in folders other runs left or damaged: real DCP checkpoints (torch's
writer), then a newer one cut short in each way a disk or a copy cuts one, a renamed copy beside them, and the
resume plan names the newest that reads whole and what it passed."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from qwen3_titan_common.hf.start import plan_start, readable_steps, unreadable_reason


def _save(folder: Path, step: int) -> Path:
    path = folder / f"step-{step}"
    dcp.save({"w": torch.arange(4096.0) * step, "b": torch.ones(16) * step}, checkpoint_id=str(path))
    return path


def _shard(step_dir: Path) -> Path:
    (shard,) = step_dir.glob("*.distcp")
    return shard


def test_the_newest_step_that_reads_whole_is_resumed_and_the_rest_are_named(tmp_path):
    folder = tmp_path / "checkpoint"
    good = _save(folder, 2)
    assert unreadable_reason(good) is None and readable_steps(folder) == (2, [])
    # Newer ones, each damaged its own way; a renamed copy of a real one (not a step folder's name).
    shutil.copytree(good, folder / "step-9.bak")
    (_save(folder, 3) / ".metadata").write_bytes(b"")
    cut = _save(folder, 4)
    with open(_shard(cut), "r+b") as file:
        file.truncate(_shard(cut).stat().st_size // 2)
    (_save(folder, 5) / ".metadata").write_bytes(b"not a checkpoint's metadata")
    (_save(folder, 6) / ".metadata").unlink()
    step, skipped = readable_steps(folder)
    assert step == 2
    assert [entry.split(" ")[0] for entry in skipped] == ["step-6", "step-5", "step-4", "step-3"]
    assert "no .metadata (a save cut short)" in skipped[0]
    assert "its .metadata does not read" in skipped[1]
    assert "holds" in skipped[2] and "cut short" in skipped[2]
    assert "its .metadata is empty" in skipped[3]
    start = plan_start(model_dir=None, checkpoint_folder=folder, checkpoint_enabled=True, download_hint=None)
    assert start.kind == "resume" and start.resume_step == 2
    assert (
        "skipped, newer but not readable whole: step-6 (" in start.message
        and "step-9.bak" not in start.message
    )


def test_a_folder_where_no_step_reads_whole_says_so_and_starts_over(tmp_path):
    folder = tmp_path / "checkpoint"
    (_save(folder, 1) / ".metadata").write_bytes(b"")
    start = plan_start(model_dir=None, checkpoint_folder=folder, checkpoint_enabled=True, download_hint=None)
    assert start.kind == "random" and "no step checkpoint in" in start.message and "step-1 (" in start.message
