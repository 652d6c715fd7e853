"""Tensor dtypes as safetensors names them on disk, and which of them a run can train from."""

from __future__ import annotations

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
