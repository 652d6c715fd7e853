"""Decides, before the Trainer is built, where a run's weights come from.

Three cases, each announced in one log line:
- the dump folder holds complete step checkpoints: resume from the newest, and do
  not load the HF directory (torchtitan would silently ignore it; upstream #1900);
- ``--hf.model_dir DIR``: the model is rebuilt from DIR's config.json, DIR's tensors
  are checked against it (names and shapes, from the safetensors headers, before any
  weight is read), and torchtitan's sharded HF reader loads them before step 1;
- neither: random initialisation.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.expected_keys import check_keys, expected_hf_shapes
from qwen3_titan_common.hf.model_dir import HFModelDir, open_model_dir

STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class StartPoint:
    kind: str  # "resume" | "hf" | "random"
    message: str
    model_dir: HFModelDir | None = None
    resume_step: int | None = None


def newest_complete_step(checkpoint_folder: Path) -> int | None:
    """Newest ``step-N`` holding DCP's ``.metadata``, which DCP writes last."""
    if not checkpoint_folder.is_dir():
        return None
    steps = [
        int(m.group(1))
        for entry in checkpoint_folder.iterdir()
        if (m := STEP_DIR.match(entry.name)) and (entry / ".metadata").is_file()
    ]
    return max(steps, default=None)


def missing_model_dir_hint(path: str, download_hint: str | None) -> str:
    hint = f"; download it with `{download_hint}`" if download_hint else ""
    return f"--hf.model_dir {path}: no such directory{hint}"


def open_checked_model_dir(path: str, download_hint: str | None = None) -> HFModelDir:
    if not Path(path).expanduser().exists() and download_hint:
        raise CheckpointError(missing_model_dir_hint(path, download_hint))
    model_dir = open_model_dir(path)
    arch = model_dir.architecture
    found = {key: entry.shape for key, entry in model_dir.tensors.items()}
    check_keys(str(model_dir.path), expected_hf_shapes(arch), found, tied=arch.tie_word_embeddings)
    return model_dir


def plan_start(
    *, model_dir: str | None, checkpoint_folder: Path, checkpoint_enabled: bool, download_hint: str | None
) -> StartPoint:
    resume = newest_complete_step(checkpoint_folder) if checkpoint_enabled else None
    if resume is not None:
        skipped = (
            f"; --hf.model_dir {model_dir} is not loaded (the step checkpoint is newer)" if model_dir else ""
        )
        return StartPoint(
            "resume", f"resuming from step {resume} in {checkpoint_folder}{skipped}", resume_step=resume
        )
    if model_dir:
        opened = open_checked_model_dir(model_dir, download_hint)
        size_gb = opened.weight_bytes / 1e9
        return StartPoint(
            "hf",
            f"loading Hugging Face weights from {opened.path} ({len(opened.tensors)} tensors, "
            f"{size_gb:.2f} GB, {opened.dtype_name}) before step 1",
            model_dir=opened,
        )
    return StartPoint("random", "no checkpoint and no --hf.model_dir: starting from random initialisation")


def absolute(path: str | os.PathLike) -> str:
    return str(Path(path).expanduser().resolve())
