"""``rms_norm`` on Trainium: the NKI kernels (``rms_norm_kernel``) as a PyTorch op with its backward.

UNTESTED ON HARDWARE (see the package docstring).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qwen3_titan_nki_moe import kernel_limits
from qwen3_titan_nki_moe.nki._sdk import launch, logical_core_size, nki_op, on_neuron
from qwen3_titan_nki_moe.nki.rms_norm_kernel import rms_norm_bwd_kernel, rms_norm_fwd_kernel
from qwen3_titan_nki_moe.ops.rms_norm import register_rms_norm_autograd


def fits(x: Tensor, weight: Tensor) -> bool:
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    return (
        rows > 0
        and rows % (kernel_limits.PARTITIONS * logical_core_size()) == 0
        and kernel_limits.rms_norm_fits(dim, x.element_size(), weight.element_size())
    )


@nki_op("qwen3_titan_nki::rms_norm", mutates_args={})
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    y = launch(rms_norm_fwd_kernel)(x2d, weight.reshape(1, -1).contiguous(), eps)
    return y.reshape(x.shape)


@nki_op("qwen3_titan_nki::rms_norm_backward", mutates_args={})
def rms_norm_backward_op(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    dim = x.shape[-1]
    grad_x, grad_w_parts = launch(rms_norm_bwd_kernel)(
        grad.reshape(-1, dim).contiguous(),
        x.reshape(-1, dim).contiguous(),
        weight.reshape(1, -1).contiguous(),
        eps,
    )
    return grad_x.reshape(x.shape), grad_w_parts.sum(0).to(weight.dtype)


register_rms_norm_autograd(rms_norm_op, rms_norm_backward_op)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """What the registry hands out: the NKI op on Neuron tensors it fits, else the reference."""
    if on_neuron(x, weight) and fits(x, weight):
        return rms_norm_op(x, weight, eps)
    return torch.ops.qwen3_titan.rms_norm(x, weight, eps)
