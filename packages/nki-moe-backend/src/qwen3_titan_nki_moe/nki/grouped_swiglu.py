"""``grouped_swiglu`` on Trainium: the block layout on the host, the NKI kernels on the device.

The registry's function puts the routed rows in the static 128-row block layout
(``qwen3_titan_nki_moe.blockwise``: a host-side gather, differentiable), and runs
``qwen3_titan_nki::grouped_swiglu_blocks`` on the slot rows. That op launches
``grouped_swiglu_fwd_kernel`` (``grouped_swiglu_kernel``) and adds the ``LNC`` programs' fp32
partial outputs; its backward launches the backward kernel (dx, and the h/dgate/dup rows) and
the weight-gradient kernel. The weights go to the kernels as torchtitan stores them: nothing
is copied per call but the activations' transposed blocks (``blockwise.block_columns``).

UNTESTED ON HARDWARE (see the package docstring).
"""

from __future__ import annotations

from torch import Tensor

from qwen3_titan_nki_moe import blockwise, kernel_limits
from qwen3_titan_nki_moe.nki._sdk import launch, logical_core_size, nki_op, on_neuron
from qwen3_titan_nki_moe.nki.grouped_swiglu_kernel import (
    grouped_swiglu_bwd_kernel,
    grouped_swiglu_fwd_kernel,
    grouped_swiglu_wgrad_kernel,
)
from qwen3_titan_nki_moe.ops import grouped_swiglu as grouped_swiglu_ops


def fits(x_RD: Tensor, w1_EFD: Tensor) -> bool:
    """The shapes the kernels take: their SBUF footprint in this dtype, tiles, and int32 offsets."""
    lnc = logical_core_size()
    experts, hidden_all, dim = w1_EFD.shape
    if hidden_all % (kernel_limits.PARTITIONS * lnc):
        return False
    itemsize = x_RD.element_size()
    hbm = kernel_limits.grouped_swiglu_hbm_bytes(x_RD.shape[0], experts, dim, hidden_all, lnc, itemsize)
    return (
        kernel_limits.grouped_swiglu_fits(dim, hidden_all // lnc, itemsize)
        and hbm < kernel_limits.MAX_HBM_TENSOR_BYTES
    )


@nki_op("qwen3_titan_nki::grouped_swiglu_blocks", mutates_args={})
def grouped_swiglu_blocks(
    x_SD: Tensor, block_start_E1: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, w2_EDF: Tensor
) -> Tensor:
    """``[N*128, D]`` slot rows -> their SwiGLU outputs (padding rows stay zero)."""
    y_parts = launch(grouped_swiglu_fwd_kernel)(
        blockwise.block_columns(x_SD), block_start_E1, w1_EFD, w3_EFD, w2_EDF
    )
    return y_parts.sum(0).reshape(x_SD.shape).to(x_SD.dtype)


@nki_op("qwen3_titan_nki::grouped_swiglu_blocks_backward", mutates_args={})
def grouped_swiglu_blocks_backward(
    grad_SD: Tensor, x_SD: Tensor, block_start_E1: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, w2_EDF: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dx_parts, h_NBF, dgate_NBF, dup_NBF = launch(grouped_swiglu_bwd_kernel)(
        blockwise.block_columns(x_SD),
        blockwise.block_columns(grad_SD),
        block_start_E1,
        w1_EFD,
        w3_EFD,
        w2_EDF,
    )
    dw1, dw3, dw2 = launch(grouped_swiglu_wgrad_kernel)(
        blockwise.block_rows(x_SD), blockwise.block_rows(grad_SD), h_NBF, dgate_NBF, dup_NBF, block_start_E1
    )
    return dx_parts.sum(0).reshape(x_SD.shape).to(x_SD.dtype), dw1, dw3, dw2


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_SD):
    x_SD, block_start_E1, w1_EFD, w3_EFD, w2_EDF = ctx.saved_tensors
    dx, dw1, dw3, dw2 = grouped_swiglu_blocks_backward(
        grad_SD.contiguous(), x_SD, block_start_E1, w1_EFD, w3_EFD, w2_EDF
    )
    return dx, None, dw1, dw3, dw2


grouped_swiglu_blocks.register_autograd(_backward, setup_context=_setup_context)


def grouped_swiglu(x_RD: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, w2_EDF: Tensor, offsets_E: Tensor) -> Tensor:
    """What the registry hands out: the block layout + NKI op on Neuron tensors it fits, else the reference.

    The layout's gathers (``to_blocks``/``from_blocks``) are ordinary differentiable torch ops,
    so autograd routes the gradient through them to the NKI backward op.
    """
    if not (on_neuron(x_RD, w1_EFD, w3_EFD, w2_EDF) and fits(x_RD, w1_EFD)):
        return grouped_swiglu_ops.reference(x_RD, w1_EFD, w3_EFD, w2_EDF, offsets_E)
    layout = blockwise.block_layout(offsets_E, x_RD.shape[0])
    y_SD = grouped_swiglu_blocks(
        blockwise.to_blocks(x_RD, layout), layout.block_start_E1, w1_EFD, w3_EFD, w2_EDF
    )
    return blockwise.from_blocks(y_SD, layout)
