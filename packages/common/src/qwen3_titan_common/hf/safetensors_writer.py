"""Writes a safetensors file tensor by tensor.

``safetensors.torch.save_file`` serialises the whole file into one buffer before
writing it, which doubles a shard's memory. The format is simple (an 8-byte
little-endian header length, a JSON header with each tensor's dtype, shape and byte
range, then the raw bytes in that order), so we write each tensor's bytes straight
from its storage instead. Files are read back by safetensors itself in the tests.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ALIGNMENT = 8


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"safetensors: '{key}' has unsupported dtype {tensor.dtype}")
        size = tensor.numel() * tensor.element_size()
        entries[key] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    # Pad with spaces so the data starts 8-byte aligned, as safetensors writes it.
    return raw + b" " * (-(len(raw) + 8) % _ALIGNMENT)


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    header = _header(tensors, metadata)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for tensor in tensors.values():
            data = tensor.detach().to("cpu").contiguous()
            if data.numel():
                f.write(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
