"""The kernel registry's ops, one module each: the ``torch.library.custom_op`` (schema, fake,
autograd with an explicit backward op) and its reference implementation in plain PyTorch.

Importing this package registers every op under the ``qwen3_titan`` namespace.
"""

from qwen3_titan_nki_moe.ops import grouped_swiglu, rms_norm, rope_hf

__all__ = ["grouped_swiglu", "rms_norm", "rope_hf"]
