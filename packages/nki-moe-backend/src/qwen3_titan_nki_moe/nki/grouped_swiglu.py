"""NKI ``grouped_swiglu``: the routed experts' SwiGLU MLP, block by block.

The rows are first put in the static block layout of ``qwen3_titan_nki_moe.blockwise``
(each expert's group padded to 128-row blocks; ``block_expert_N`` names each block's expert).
The kernels loop over the blocks; each block loads its expert's weights with a dynamic-offset
DMA (``.ap(..., scalar_offset=<expert id in SBUF>, indirect_dim=0)``). The grid is ``[LNC]``
and program ``p`` owns the slice ``F_p`` of the intermediate dimension (``F / LNC`` wide, hence
"moe_intermediate_size a multiple of 128 x LNC"), so no two programs write the same output:

forward, per block (tokens t = 128 rows, everything transposed so D or F sits on partitions)::

    gateT[F_p, t] = w1[e][F_p, :] @ xT[:, t]        (nc_matmul, contraction over D in 128 tiles)
    upT  [F_p, t] = w3[e][F_p, :] @ xT[:, t]
    hT   = silu(gateT) * upT                        (rounded to the input dtype)
    y_p[t, D]    += hT^T @ w2[e][:, F_p]^T          (fp32 partial; the wrapper sums the programs)

backward, per block: the same recompute, then ``dhT = w2[e][:, F_p]^T @ dyT``,
``dupT = dhT * silu(gateT)``, ``dgateT = dhT * upT * silu'(gateT)`` and the partial
``dx_p[t, D] = dgateT^T @ w1[e][F_p] + dupT^T @ w3[e][F_p]``. The kernel writes ``hT``,
``dgateT`` and ``dupT`` (``[F, N*128]``) and the wrapper forms the weight gradients with
``F.grouped_mm`` over the padded groups (TorchNeuron's grouped GEMM; padding rows are
zero). A production kernel would keep an expert's weights resident across its consecutive
blocks and accumulate the weight gradients on chip; this one re-reads them per block.

UNTESTED ON HARDWARE (see the package docstring).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from qwen3_titan_nki_moe import blockwise
from qwen3_titan_nki_moe.nki._sdk import (
    MOVING_MAX,
    P,
    logical_core_size,
    nisa,
    nki,
    nki_op,
    nl,
    on_neuron,
    wrap_nki,
)
from qwen3_titan_nki_moe.ops import grouped_swiglu as grouped_swiglu_ops


def _load_expert_tile(dst, weight, row0, col0: int, rows: int, cols: int, expert):
    """``dst[:rows, :cols] = weight[expert, row0:row0+rows, col0:col0+cols]`` with a runtime ``expert``.

    ``expert`` is the SBUF scratch of :func:`_block_expert`; the dynamic offset goes through a
    DGE access pattern on dimension 0 of the weight (the expert dimension).
    """
    inner = weight.shape[2]
    nisa.dma_copy(
        dst=dst,
        src=weight.ap(
            pattern=[[inner, rows], [1, cols]],
            offset=row0 * inner + col0,
            scalar_offset=expert.ap(pattern=[[1, 1], [1, 1]], offset=0),
            indirect_dim=0,
        ),
    )


def _block_expert(block_expert, n):
    """Block ``n``'s expert id, in element 0 of a partition-tall int32 scratch.

    The scratch is referenced at offset 0 (a computed SBUF offset would bake an address into
    the descriptor) and spans 128 partitions, which lets the compiler bound the indirect index
    (expert counts up to 128, Qwen3-30B-A3B's).
    """
    expert = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=expert[0:1, 0:1], src=block_expert[nl.ds(n, 1), 0:1])
    return expert


def _load_transposed_block(src_T, n, d_tiles: int, dtype):
    """``[128 (d), d_tiles, 128 (t)]``: block ``n``'s columns of a ``[D, N*128]`` tensor."""
    tile = nl.ndarray((P, d_tiles, P), dtype=dtype, buffer=nl.sbuf)
    for kd in nl.affine_range(d_tiles):
        nisa.dma_copy(dst=tile[:, kd, :], src=src_T[nl.ds(kd * P, P), nl.ds(n * P, P)])
    return tile


def _gate_up(xT, w1t, w3t, f0, d_tiles: int, expert, dtype):
    """fp32 ``gateT``/``upT`` ``[128 (f), 128 (t)]`` for the intermediate rows ``f0:f0+128``."""
    gate = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
    up = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
    for kd in range(d_tiles):  # static: accumulate flag differs on the first tile
        w1_t = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
        w3_t = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
        # w1t/w3t are [E, D, F]: a [d, f] tile is the stationary operand (contraction over d).
        _load_expert_tile(w1_t, w1t, kd * P, f0, P, P, expert)
        _load_expert_tile(w3_t, w3t, kd * P, f0, P, P, expert)
        nisa.nc_matmul(dst=gate, stationary=w1_t, moving=xT[:, kd, :], accumulate=kd > 0)
        nisa.nc_matmul(dst=up, stationary=w3_t, moving=xT[:, kd, :], accumulate=kd > 0)
    # To SBUF (fp32): the elementwise math below then never reads two PSUM operands at once.
    gate_s = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    up_s = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=gate_s, src=gate)
    nisa.tensor_copy(dst=up_s, src=up)
    return gate_s, up_s


@nki.jit
def grouped_swiglu_fwd_kernel(xT, block_expert, w1t, w3t, w2t, lnc: int):
    """xT [D, N*128]; block_expert [N, 1] int32; w1t/w3t [E, D, F]; w2t [E, F, D] -> y [LNC, N*128, D] fp32."""
    dim, slots = xT.shape
    blocks = slots // P
    hidden = w1t.shape[2]
    d_tiles = dim // P
    f_tiles = hidden // (P * lnc)
    pid = nl.program_id(0)
    y_parts = nl.ndarray((lnc, slots, dim), dtype=nl.float32, buffer=nl.shared_hbm)

    for n in nl.sequential_range(blocks):
        expert = _block_expert(block_expert, n)
        x_block = _load_transposed_block(xT, n, d_tiles, xT.dtype)
        y_acc = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=y_acc, value=0.0)
        for kf in nl.sequential_range(f_tiles):
            f0 = (pid * f_tiles + kf) * P
            gate, up = _gate_up(x_block, w1t, w3t, f0, d_tiles, expert, xT.dtype)
            act = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=act, op=nl.silu, data=gate)
            h_T = nl.ndarray((P, P), dtype=xT.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=h_T, data1=act, data2=up, op=nl.multiply)
            for c in range((dim + MOVING_MAX - 1) // MOVING_MAX):
                c0 = c * MOVING_MAX
                width = min(MOVING_MAX, dim - c0)
                w2_t = nl.ndarray((P, width), dtype=xT.dtype, buffer=nl.sbuf)
                _load_expert_tile(w2_t, w2t, f0, c0, P, width, expert)
                y_ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=y_ps, stationary=h_T, moving=w2_t)  # [t, d]
                nisa.tensor_tensor(
                    dst=y_acc[:, c0 : c0 + width], data1=y_acc[:, c0 : c0 + width], data2=y_ps, op=nl.add
                )
        nisa.dma_copy(dst=y_parts[pid, nl.ds(n * P, P), :], src=y_acc)
    return y_parts


@nki.jit
def grouped_swiglu_bwd_kernel(xT, dyT, block_expert, w1t, w3t, w1, w3, w2, lnc: int):
    """Recompute + backward. w1/w3 [E, F, D] and w2 [E, D, F] as stored; w1t/w3t [E, D, F].

    Returns dx [LNC, N*128, D] fp32 partials and hT, dgateT, dupT [F, N*128] (input dtype).
    """
    dim, slots = xT.shape
    blocks = slots // P
    hidden = w1t.shape[2]
    d_tiles = dim // P
    f_tiles = hidden // (P * lnc)
    pid = nl.program_id(0)
    dx_parts = nl.ndarray((lnc, slots, dim), dtype=nl.float32, buffer=nl.shared_hbm)
    h_T_out = nl.ndarray((hidden, slots), dtype=xT.dtype, buffer=nl.shared_hbm)
    dgate_T_out = nl.ndarray((hidden, slots), dtype=xT.dtype, buffer=nl.shared_hbm)
    dup_T_out = nl.ndarray((hidden, slots), dtype=xT.dtype, buffer=nl.shared_hbm)

    for n in nl.sequential_range(blocks):
        expert = _block_expert(block_expert, n)
        x_block = _load_transposed_block(xT, n, d_tiles, xT.dtype)
        dy_block = _load_transposed_block(dyT, n, d_tiles, xT.dtype)
        dx_acc = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dx_acc, value=0.0)
        for kf in nl.sequential_range(f_tiles):
            f0 = (pid * f_tiles + kf) * P
            gate, up = _gate_up(x_block, w1t, w3t, f0, d_tiles, expert, xT.dtype)
            # dhT[f, t] = sum_d w2[e][d, f] * dyT[d, t]
            dh_ps = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
            for kd in range(d_tiles):
                w2_t = nl.ndarray((P, P), dtype=xT.dtype, buffer=nl.sbuf)
                _load_expert_tile(w2_t, w2, kd * P, f0, P, P, expert)
                nisa.nc_matmul(dst=dh_ps, stationary=w2_t, moving=dy_block[:, kd, :], accumulate=kd > 0)
            dh = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=dh, src=dh_ps)

            sig = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sig, op=nl.sigmoid, data=gate)
            silu = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=silu, data1=gate, data2=sig, op=nl.multiply)
            h_T = nl.ndarray((P, P), dtype=xT.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=h_T, data1=silu, data2=up, op=nl.multiply)
            dup_T = nl.ndarray((P, P), dtype=xT.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dup_T, data1=dh, data2=silu, op=nl.multiply)
            # silu'(g) = sig * (1 + g * (1 - sig))
            one_minus = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(
                dst=one_minus, data=sig, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0
            )
            g_one_minus = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=g_one_minus, data1=gate, data2=one_minus, op=nl.multiply)
            one_plus = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(dst=one_plus, data=g_one_minus, op0=nl.add, operand0=1.0)
            slope = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=slope, data1=one_plus, data2=sig, op=nl.multiply)
            dh_up = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dh_up, data1=dh, data2=up, op=nl.multiply)
            dgate_T = nl.ndarray((P, P), dtype=xT.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dgate_T, data1=dh_up, data2=slope, op=nl.multiply)

            nisa.dma_copy(dst=h_T_out[nl.ds(f0, P), nl.ds(n * P, P)], src=h_T)
            nisa.dma_copy(dst=dup_T_out[nl.ds(f0, P), nl.ds(n * P, P)], src=dup_T)
            nisa.dma_copy(dst=dgate_T_out[nl.ds(f0, P), nl.ds(n * P, P)], src=dgate_T)

            # dx[t, d] += dgateT^T @ w1[e][f, d] + dupT^T @ w3[e][f, d]
            for c in range((dim + MOVING_MAX - 1) // MOVING_MAX):
                c0 = c * MOVING_MAX
                width = min(MOVING_MAX, dim - c0)
                w1_r = nl.ndarray((P, width), dtype=xT.dtype, buffer=nl.sbuf)
                w3_r = nl.ndarray((P, width), dtype=xT.dtype, buffer=nl.sbuf)
                _load_expert_tile(w1_r, w1, f0, c0, P, width, expert)
                _load_expert_tile(w3_r, w3, f0, c0, P, width, expert)
                dx_ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=dx_ps, stationary=dgate_T, moving=w1_r, accumulate=False)
                nisa.nc_matmul(dst=dx_ps, stationary=dup_T, moving=w3_r, accumulate=True)
                nisa.tensor_tensor(
                    dst=dx_acc[:, c0 : c0 + width], data1=dx_acc[:, c0 : c0 + width], data2=dx_ps, op=nl.add
                )
        nisa.dma_copy(dst=dx_parts[pid, nl.ds(n * P, P), :], src=dx_acc)
    return dx_parts, h_T_out, dgate_T_out, dup_T_out


def fits(x_RD: Tensor, w1_EFD: Tensor) -> bool:
    dim, hidden = x_RD.shape[1], w1_EFD.shape[1]
    return dim % P == 0 and hidden % (P * logical_core_size()) == 0


def _t(weight: Tensor) -> Tensor:
    return weight.transpose(1, 2).contiguous()


@nki_op("qwen3_titan_nki::grouped_swiglu_blocks", mutates_args={})
def grouped_swiglu_blocks(
    x_SD: Tensor,
    block_expert_N: Tensor,
    padded_offsets_E: Tensor,
    w1_EFD: Tensor,
    w3_EFD: Tensor,
    w2_EDF: Tensor,
) -> Tensor:
    """``[N*128, D]`` rows in the block layout -> their SwiGLU outputs (padding rows stay zero)."""
    lnc = logical_core_size()
    y_parts = wrap_nki(grouped_swiglu_fwd_kernel)[lnc](
        x_SD.t().contiguous(), block_expert_N.reshape(-1, 1), _t(w1_EFD), _t(w3_EFD), _t(w2_EDF), lnc
    )
    return y_parts.sum(0).to(x_SD.dtype)


@nki_op("qwen3_titan_nki::grouped_swiglu_blocks_backward", mutates_args={})
def grouped_swiglu_blocks_backward(
    grad_SD: Tensor,
    x_SD: Tensor,
    block_expert_N: Tensor,
    padded_offsets_E: Tensor,
    w1_EFD: Tensor,
    w3_EFD: Tensor,
    w2_EDF: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    lnc = logical_core_size()
    x_T = x_SD.t().contiguous()
    dy_T = grad_SD.t().contiguous()
    dx_parts, h_T, dgate_T, dup_T = wrap_nki(grouped_swiglu_bwd_kernel)[lnc](
        x_T, dy_T, block_expert_N.reshape(-1, 1), _t(w1_EFD), _t(w3_EFD), w1_EFD, w3_EFD, w2_EDF, lnc
    )
    # Weight gradients: per expert, sums over its (padded) rows; grouped over the row dimension.
    dw1 = F.grouped_mm(dgate_T, x_SD, offs=padded_offsets_E)
    dw3 = F.grouped_mm(dup_T, x_SD, offs=padded_offsets_E)
    dw2 = F.grouped_mm(dy_T, h_T.t(), offs=padded_offsets_E)
    return dx_parts.sum(0).to(x_SD.dtype), dw1, dw3, dw2


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_SD):
    x_SD, block_expert_N, padded_offsets_E, w1_EFD, w3_EFD, w2_EDF = ctx.saved_tensors
    dx, dw1, dw3, dw2 = grouped_swiglu_blocks_backward(
        grad_SD.contiguous(), x_SD, block_expert_N, padded_offsets_E, w1_EFD, w3_EFD, w2_EDF
    )
    return dx, None, None, dw1, dw3, dw2


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
        blockwise.to_blocks(x_RD, layout),
        layout.block_expert_N,
        layout.padded_offsets_E,
        w1_EFD,
        w3_EFD,
        w2_EDF,
    )
    return blockwise.from_blocks(y_SD, layout)
