"""Reads a safetensors file's header without reading its tensors.

The header says every tensor's dtype, shape and byte range, which is all we need to
check a checkpoint against a model before any weight is read, and to catch a file
cut short by a failed download (its data ends before the header says it should).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from qwen3_titan_common.hf.errors import CheckpointError

_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16", "F32"
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_length = f.read(8)
        if len(raw_length) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw_length)
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                f"{path}: corrupt or truncated safetensors file (header length {length} > file)"
            )
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (expected a JSON object)")
    entries = {}
    data_end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            entries[key] = TensorEntry(path, str(info["dtype"]), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for '{key}'") from None
        data_end = max(data_end, int(end))
    if 8 + length + data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes, header promises {8 + length + data_end}); "
            "download it again"
        )
    return entries
