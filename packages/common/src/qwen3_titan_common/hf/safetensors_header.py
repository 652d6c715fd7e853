"""Reads a safetensors file's header without reading its tensors; the dtypes it names.

The header says every tensor's dtype and shape, which is all we need to check a
checkpoint against a model before any weight is read. ``safetensors.safe_open``
reads it and refuses a file whose header is corrupt or whose data does not cover
exactly what the header promises; its error becomes one line naming the file. Tensor dtypes are
the names safetensors gives them on disk (:data:`SAFETENSORS_DTYPES`), of which a run trains from
:data:`TRAINABLE`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from qwen3_titan_common.errors import CheckpointError

# safetensors dtype name -> (torch dtype name, bits per element). The names torch prints, so that
# a message shows the dtype that is on disk, not the one a run would convert it to.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 64),
    "F32": ("float32", 32),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "F4": ("float4_e2m1fn_x2", 4),
    "I64": ("int64", 64),
    "I32": ("int32", 32),
    "I16": ("int16", 16),
    "I8": ("int8", 8),
    "U64": ("uint64", 64),
    "U32": ("uint32", 32),
    "U16": ("uint16", 16),
    "U8": ("uint8", 8),
    "BOOL": ("bool", 8),
}
# Weights a run trains from: full floating types. float8/float4 weights come with scales in other
# tensors (a quantised checkpoint); read as plain values they are not the model's weights.
TRAINABLE = ("F32", "BF16", "F16", "F64")


def torch_name(safetensors_dtype: str) -> str:
    return SAFETENSORS_DTYPES.get(safetensors_dtype, (safetensors_dtype.lower(), 0))[0]


def itemsize_bits(safetensors_dtype: str) -> int | None:
    entry = SAFETENSORS_DTYPES.get(safetensors_dtype)
    return entry[1] if entry else None


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
            tensors = {key: info for key, info in header.items() if key != "__metadata__"}
            data_end = max((int(info["data_offsets"][1]) for info in tensors.values()), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return CheckpointError(f"{path}: corrupt safetensors header ({err})")
    promised = 8 + length + data_end
    if promised > size:
        return CheckpointError(
            f"{path}: truncated safetensors file ({size} bytes, header promises {promised}); download it again"
        )
    culprit = _offsets_culprit(tensors)
    if culprit is not None:
        return CheckpointError(f"{path}: corrupt safetensors header: {culprit}")
    return CheckpointError(f"{path}: corrupt safetensors file ({err})")


def _offsets_culprit(tensors: dict) -> str | None:
    """The first tensor whose data_offsets do not span its shape x dtype, said in bytes.

    safetensors refuses such a header without naming the tensor; this names it, for a file
    already refused (the numbers come from the header alone, no data is read).
    """
    for key, info in sorted(tensors.items(), key=lambda item: item[1]["data_offsets"][0]):
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            numel = 1
            for dim in info["shape"]:
                numel *= int(dim)
            bits = itemsize_bits(info["dtype"])
        except (KeyError, TypeError, ValueError):
            return f"tensor '{key}' has no valid dtype, shape and data_offsets"
        if bits is not None and numel * bits != (end - begin) * 8:
            return (
                f"tensor '{key}': shape {list(info['shape'])} x {info['dtype']} is {numel * bits // 8} bytes, "
                f"but its data_offsets [{begin}, {end}] span {end - begin}"
            )
    return None
