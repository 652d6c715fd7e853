"""The Neuron SDK imports every kernel module needs, in one place (Trainium hosts only)."""

from __future__ import annotations

try:
    import nki
    import nki.isa as nisa
    import nki.language as nl
    from torch_neuronx import nki_op, wrap_nki
except ImportError as err:  # CPU/CUDA hosts, or PyPI's placeholder packages
    raise ImportError(
        "qwen3_titan_nki_moe.nki needs torch-neuronx and nki from the Neuron package repository "
        f"(PyPI only has placeholders); the kernel registry imports it only on a Neuron host: {err}"
    ) from err

from qwen3_titan_common.runtime.neuron_env import logical_core_size

# Partition count of SBUF/PSUM tiles: every kernel tiles rows (or the contraction) by it.
P = 128
# Largest moving free size of one nc_matmul (and one PSUM bank of fp32).
MOVING_MAX = 512

__all__ = ["MOVING_MAX", "P", "logical_core_size", "nisa", "nki", "nki_op", "nl", "on_neuron", "wrap_nki"]


def on_neuron(*tensors) -> bool:
    return all(t.device.type == "neuron" for t in tensors)
