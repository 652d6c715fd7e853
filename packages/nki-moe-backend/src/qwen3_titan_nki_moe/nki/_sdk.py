"""The torch-neuronx side of the kernels, in one place (Trainium hosts only).

``launch(kernel)`` is the kernel's wrapped callable for this process's logical core size,
built once (``qwen3_titan_nki_moe.kernel_launch``): ``wrap_nki(kernel)[(lnc,)]``.
"""

from __future__ import annotations

from qwen3_titan_nki_moe.nki import missing_neuron_package

try:
    from torch_neuronx import nki_op, wrap_nki
except ImportError as err:  # CPU/CUDA hosts, or PyPI's placeholder packages; the registry imports
    # this module only on a Neuron host.
    raise missing_neuron_package("qwen3_titan_nki_moe.nki needs torch-neuronx and nki", err) from err

from qwen3_titan_common.runtime.neuron_env import logical_core_size

from qwen3_titan_nki_moe.kernel_launch import KernelLaunchers

__all__ = ["launch", "logical_core_size", "nki_op", "on_neuron"]

_LAUNCHERS = KernelLaunchers(wrap_nki)


def launch(kernel):
    """The wrapped, launchable ``kernel`` on a ``(LNC,)`` grid (LNC = ``NEURON_LOGICAL_NC_CONFIG``)."""
    return _LAUNCHERS(kernel, logical_core_size())


def on_neuron(*tensors) -> bool:
    return all(t.device.type == "neuron" for t in tensors)
