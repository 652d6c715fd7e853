"""Where an export may be written, so that no export ever replaces what the user owns.

Exports go to ``<export root>/step-N``. Each completed export carries :data:`EXPORT_MARKER`, written
into its temporary directory as the last file before the rename that completes it; an existing
``step-N`` is replaced only when it carries the marker. Before training, the export root is checked as
a whole (:func:`check_export_root`): it must not be, hold or lie inside the model directory being
trained or the checkpoint folder, and if it exists it may hold nothing but this project's exports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from qwen3_titan_common.hf.errors import CheckpointError

EXPORT_MARKER = ".qwen3-titan-export.json"
# What this project writes in an export root: model exports (step-N), and a LoRA run's adapters
# (adapter-step-N) and the frozen base they apply to (base).
_OWN_DIR = re.compile(r"^(step-\d+|adapter-step-\d+|base)$")
# Leftovers of this project's own exports that were killed (export.py and adapter.py name them so).
_OWN_LEFTOVER = re.compile(r"^\.(step-\d+|adapter-step-\d+|base)\.(partial|old)-\d+$")


class ExportTargetError(CheckpointError):
    """An export would write over something this project did not write."""


def is_completed_export(directory: Path) -> bool:
    return (directory / EXPORT_MARKER).is_file()


def write_export_marker(directory: Path, files: list[str]) -> None:
    record = {"written_by": "qwen3-titan", "complete": True, "files": sorted(files)}
    (directory / EXPORT_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def check_replaceable(out_dir: Path) -> None:
    """An existing export target must be a completed export of ours; called right before writing."""
    if out_dir.exists() and not (out_dir.is_dir() and is_completed_export(out_dir)):
        raise ExportTargetError(
            f"{out_dir}: exists and is not an export this project wrote (no {EXPORT_MARKER}); it is left "
            "untouched: move it away or pass another --hf.export_dir"
        )


def _related(a: Path, b: Path) -> str | None:
    if a == b:
        return "is"
    if b in a.parents:
        return "lies inside"
    if a in b.parents:
        return "contains"
    return None


def check_export_root(
    root: Path, *, shown: str, model_dir: Path | None, checkpoint_dir: Path, dump_folder: Path
) -> None:
    """Refuse an export root that would overwrite or mix with what the user owns; reads only, creates nothing.

    ``shown`` is how the message names the root (the flag, or the default under --dump_folder).
    """
    root = root.expanduser().resolve()
    if model_dir is not None:
        model_dir = model_dir.expanduser().resolve()
        relation = _related(root, model_dir)
        if relation is not None:
            raise ExportTargetError(
                f"{shown} {root}: {relation} the model directory being trained (--hf.model_dir {model_dir}); "
                "an export there could replace its files: pass another --hf.export_dir"
            )
        relation = _related(dump_folder.expanduser().resolve(), model_dir)
        if relation in ("is", "lies inside"):
            raise ExportTargetError(
                f"--dump_folder {dump_folder}: {relation} the model directory being trained "
                f"(--hf.model_dir {model_dir}); checkpoints and exports must not go into it: pass another --dump_folder"
            )
    checkpoint_dir = checkpoint_dir.expanduser().resolve()
    relation = _related(root, checkpoint_dir)
    if relation is not None:
        raise ExportTargetError(
            f"{shown} {root}: {relation} the checkpoint folder {checkpoint_dir}; exports and step checkpoints "
            "share step-N names there: pass another --hf.export_dir"
        )
    if not root.exists():
        return
    if not root.is_dir():
        raise ExportTargetError(f"{shown} {root}: is a file, not a directory; pass a directory for exports")
    foreign = sorted(
        entry.name
        for entry in root.iterdir()
        if not (
            (_OWN_DIR.match(entry.name) and entry.is_dir() and is_completed_export(entry))
            or _OWN_LEFTOVER.match(entry.name)
        )
    )
    if foreign:
        listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ExportTargetError(
            f"{shown} {root}: an existing directory holding files this project did not write ({listed}); "
            "exports go only to a new or empty directory or one holding earlier exports of this project: "
            "pass another --hf.export_dir"
        )
