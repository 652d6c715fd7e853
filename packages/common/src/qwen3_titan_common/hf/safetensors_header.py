"""Reads a safetensors file's header without reading its tensors.

The header says every tensor's dtype and shape, which is all we need to check a
checkpoint against a model before any weight is read. ``safetensors.safe_open``
reads it and refuses a file whose header is corrupt or whose data does not cover
exactly what the header promises; its error becomes one line naming the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from qwen3_titan_common.hf.errors import CheckpointError


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16", "F32"
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorEntry]:
    try:
        with safe_open(str(path), framework="pt") as f:
            entries = {}
            for key in f.keys():
                tensor = f.get_slice(key)
                entries[key] = TensorEntry(path, tensor.get_dtype(), tuple(tensor.get_shape()))
            return entries
    except SafetensorError as err:
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: SafetensorError) -> CheckpointError:
    """Why safetensors refused ``path``, in the terms a user can act on.

    safetensors reports *that* the data does not match the header, not whether the file
    was cut short: a download that stopped early (fetch it again) and a corrupt header
    (the file is not what it claims) need different remedies. So, only for a file it has
    already refused, this compares the file's size with the size its header promises.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_length = f.read(8)
        if len(raw_length) < 8:
            return CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw_length)
        if 8 + length > size:
            return CheckpointError(
                f"{path}: corrupt or truncated safetensors file (header length {length} > file)"
            )
        try:
            header = json.loads(f.read(length))
            data_end = max(
                (int(info["data_offsets"][1]) for key, info in header.items() if key != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return CheckpointError(f"{path}: corrupt safetensors header ({err})")
    promised = 8 + length + data_end
    if promised > size:
        return CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes, header promises {promised}); download it again"
        )
    return CheckpointError(f"{path}: corrupt safetensors file ({err})")
