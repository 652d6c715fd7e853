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


def unreadable_reason(step_dir: Path) -> str | None:
    """Why DCP could not load the step checkpoint ``step_dir``, or None when it reads whole: DCP writes its
    ``.metadata`` last, so a missing or empty one is a save cut short; one that does not parse is damaged; a
    shard file shorter than the metadata says it is was cut (a copy or a disk that filled)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = step_dir / ".metadata"
    if not metadata.is_file():
        return "no .metadata (a save cut short)"
    if metadata.stat().st_size == 0:
        return "its .metadata is empty (a save cut short)"
    try:
        storage = FileSystemReader(str(step_dir)).read_metadata().storage_data
    except Exception as err:  # torch's reader raises whatever its unpickler meets in a damaged file
        return f"its .metadata does not read ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in (storage or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            needed[path] = max(needed.get(path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = step_dir / name
        found = shard.stat().st_size if shard.is_file() else None
        if found is None or found < size:
            what = "is missing" if found is None else f"holds {found:,} of its {size:,} bytes"
            return f"its shard {name} {what} (cut short)"
    return None


def readable_steps(checkpoint_folder: Path) -> tuple[int | None, list[str]]:
    """The newest step checkpoint (a folder named exactly ``step-N``) that reads whole, and what was skipped
    on the way to it, newest first, each as ``step-N (why)``. Only the step being resumed is read in full."""
    if not checkpoint_folder.is_dir():
        return None, []
    steps = sorted(
        (int(m.group(1)), entry)
        for entry in checkpoint_folder.iterdir()
        if (m := STEP_DIR.match(entry.name)) and entry.is_dir()
    )
    skipped = []
    for step, entry in reversed(steps):
        why = unreadable_reason(entry)
        if why is None:
            return step, skipped
        skipped.append(f"{entry.name} ({why})")
    return None, skipped


def newest_complete_step(checkpoint_folder: Path) -> int | None:
    """Newest ``step-N`` that DCP can load whole (:func:`readable_steps`)."""
    return readable_steps(checkpoint_folder)[0]


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
    resume, unreadable = readable_steps(checkpoint_folder) if checkpoint_enabled else (None, [])
    passed = f"; skipped, newer but not readable whole: {', '.join(unreadable)}" if unreadable else ""
    if resume is not None:
        skipped = (
            f"; --hf.model_dir {model_dir} is not loaded (the step checkpoint is newer)" if model_dir else ""
        )
        return StartPoint(
            "resume",
            f"resuming from step {resume} in {checkpoint_folder}{skipped}{passed}",
            resume_step=resume,
        )
    passed = (
        f" (no step checkpoint in {checkpoint_folder} reads whole: {', '.join(unreadable)})"
        if unreadable
        else ""
    )
    if model_dir:
        opened = open_checked_model_dir(model_dir, download_hint)
        size_gb = opened.weight_bytes / 1e9
        return StartPoint(
            "hf",
            f"loading Hugging Face weights from {opened.path} ({len(opened.tensors)} tensors, "
            f"{size_gb:.2f} GB, {opened.dtype_name}) before step 1{passed}",
            model_dir=opened,
        )
    return StartPoint(
        "random", f"no checkpoint and no --hf.model_dir: starting from random initialisation{passed}"
    )


def absolute(path: str | os.PathLike) -> str:
    return str(Path(path).expanduser().resolve())
