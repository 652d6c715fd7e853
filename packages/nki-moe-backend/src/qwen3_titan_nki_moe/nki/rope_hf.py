"""``rope_hf`` on Trainium: the NKI kernel (``rope_hf_kernel``) as a PyTorch op with its backward.

UNTESTED ON HARDWARE (see the package docstring).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qwen3_titan_nki_moe import kernel_limits
from qwen3_titan_nki_moe.nki._sdk import launch, logical_core_size, nki_op, on_neuron
from qwen3_titan_nki_moe.nki.rope_hf_kernel import rope_hf_kernel


def fits(x: Tensor, cos: Tensor) -> bool:
    """The shapes this kernel takes (the registry's constraints check the same at start)."""
    seq, head_dim = x.shape[-2], x.shape[-1]
    return (
        x.dim() == 4
        and seq % (kernel_limits.PARTITIONS * logical_core_size()) == 0
        and kernel_limits.rope_hf_fits(head_dim, x.element_size())
        and cos.shape[-2] == seq
    )


def rows_per_partition(x: Tensor) -> int:
    """Positions per partition per transfer for ``x`` (``kernel_limits.rope_rows_per_partition``)."""
    seq, head_dim = x.shape[-2], x.shape[-1]
    tiles = seq // (kernel_limits.PARTITIONS * logical_core_size())
    return kernel_limits.rope_rows_per_partition(tiles, head_dim, x.element_size())


def _launch(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    return launch(rope_hf_kernel)(
        x.contiguous(), cos.contiguous(), sin.contiguous(), backward, rows_per_partition(x)
    )


@nki_op("qwen3_titan_nki::rope_hf", mutates_args={})
def rope_hf_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _launch(q, cos, sin, False), _launch(k, cos, sin, False)


@nki_op("qwen3_titan_nki::rope_hf_backward", mutates_args={})
def rope_hf_backward_op(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _launch(grad_q, cos, sin, True), _launch(grad_k, cos, sin, True)


def _setup_context(ctx, inputs, output) -> None:
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_hf_backward_op(grad_q, grad_k, cos, sin)
    return dq, dk, None, None


rope_hf_op.register_autograd(_backward, setup_context=_setup_context)


def rope_hf(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """What the registry hands out: the NKI op on Neuron tensors it fits, else the reference."""
    if on_neuron(q, k, cos, sin) and fits(q, cos) and fits(k, cos):
        return rope_hf_op(q, k, cos, sin)
    return torch.ops.qwen3_titan.rope_hf(q, k, cos, sin)
