"""NKI ``rms_norm``: RMSNorm over the last dimension, forward and backward.

Rows (every leading dimension flattened) go 128 to a tile, one row per partition; the grid
is ``[LNC]`` and program ``p`` takes row tiles ``p*T .. p*T+T-1``. Statistics are fp32::

    rstd = 1 / sqrt(mean(x^2) + eps)           y  = (x * rstd) -> dtype, * weight -> dtype
    dx = rstd * (g*w - x_hat * mean(g*w*x_hat))  dw = sum over rows of g * x_hat

``dw`` is reduced across the 128 partitions with a ones-vector matmul (Tensor Engine) and
written per program (``[LNC, D]``); the wrapper adds the programs' parts.

UNTESTED ON HARDWARE (see the package docstring).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qwen3_titan_nki_moe.constraints import MAX_NORM_DIM
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


def _broadcast_rows(weight, dim: int):
    """``weight`` ``[1, D]`` (HBM) copied onto all 128 partitions: ones[1, P]^T @ w[1, D]."""
    ones = nl.ndarray((1, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    w_row = nl.ndarray((1, dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_row, src=weight[0:1, :])
    w_rows = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
    for c in range((dim + MOVING_MAX - 1) // MOVING_MAX):  # static: chunk widths differ
        c0 = c * MOVING_MAX
        width = min(MOVING_MAX, dim - c0)
        ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=ones, moving=w_row[:, c0 : c0 + width])
        nisa.tensor_copy(dst=w_rows[:, c0 : c0 + width], src=ps)
    return w_rows


def _rstd(x_t, dim: int, eps: float):
    """fp32 ``[P, 1]``: 1 / sqrt(mean(x^2) + eps) of each row."""
    sq = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=sq, data1=x_t, data2=x_t, op=nl.multiply)
    ss = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=ss, op=nl.add, data=sq, axis=1)
    ms = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ms, data=ss, op0=nl.multiply, operand0=1.0 / dim, op1=nl.add, operand1=eps)
    rstd = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=ms)
    return rstd


@nki.jit
def rms_norm_fwd_kernel(x, weight, eps: float, lnc: int):
    rows, dim = x.shape
    tiles_per_program = rows // (P * lnc)
    pid = nl.program_id(0)
    y = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    w_rows = _broadcast_rows(weight, dim)
    for t in nl.affine_range(tiles_per_program):
        r0 = (pid * tiles_per_program + t) * P
        x_t = nl.ndarray((P, dim), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_t, src=x[nl.ds(r0, P), :])
        rstd = _rstd(x_t, dim, eps)
        x_hat = nl.ndarray((P, dim), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=x_hat, data=x_t, op0=nl.multiply, operand0=rstd)
        y_t = nl.ndarray((P, dim), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=y_t, data1=x_hat, data2=w_rows, op=nl.multiply)
        nisa.dma_copy(dst=y[nl.ds(r0, P), :], src=y_t)
    return y


@nki.jit
def rms_norm_bwd_kernel(grad, x, weight, eps: float, lnc: int):
    rows, dim = x.shape
    tiles_per_program = rows // (P * lnc)
    pid = nl.program_id(0)
    grad_x = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    grad_w_parts = nl.ndarray((lnc, dim), dtype=nl.float32, buffer=nl.shared_hbm)
    w_rows = _broadcast_rows(weight, dim)
    ones_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones_col, value=1.0)
    grad_w = nl.ndarray((1, dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=grad_w, value=0.0)

    for t in nl.sequential_range(tiles_per_program):  # grad_w accumulates across tiles
        r0 = (pid * tiles_per_program + t) * P
        x_t = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        g_t = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_t, src=x[nl.ds(r0, P), :])
        nisa.dma_copy(dst=g_t, src=grad[nl.ds(r0, P), :])
        rstd = _rstd(x_t, dim, eps)
        x_hat = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=x_hat, data=x_t, op0=nl.multiply, operand0=rstd)
        gw = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gw, data1=g_t, data2=w_rows, op=nl.multiply)
        prod = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod, data1=gw, data2=x_hat, op=nl.multiply)
        dot = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=dot, op=nl.add, data=prod, axis=1)
        mean_dot = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=mean_dot, data=dot, op0=nl.multiply, operand0=1.0 / dim)
        # dx = rstd * (gw - x_hat * mean_dot)
        proj = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=proj, data=x_hat, op0=nl.multiply, operand0=mean_dot)
        diff = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=diff, data1=gw, data2=proj, op=nl.subtract)
        dx_t = nl.ndarray((P, dim), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dx_t, data=diff, op0=nl.multiply, operand0=rstd)
        nisa.dma_copy(dst=grad_x[nl.ds(r0, P), :], src=dx_t)
        # grad_w += ones^T @ (g * x_hat): the sum over this tile's 128 rows.
        gx = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gx, data1=g_t, data2=x_hat, op=nl.multiply)
        for c in range((dim + MOVING_MAX - 1) // MOVING_MAX):
            c0 = c * MOVING_MAX
            width = min(MOVING_MAX, dim - c0)
            ps = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps, stationary=ones_col, moving=gx[:, c0 : c0 + width])
            nisa.tensor_tensor(
                dst=grad_w[:, c0 : c0 + width], data1=grad_w[:, c0 : c0 + width], data2=ps, op=nl.add
            )
    nisa.dma_copy(dst=grad_w_parts[nl.ds(pid, 1), :], src=grad_w)
    return grad_x, grad_w_parts


def fits(x: Tensor) -> bool:
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    return dim <= MAX_NORM_DIM and rows > 0 and rows % (P * logical_core_size()) == 0


@nki_op("qwen3_titan_nki::rms_norm", mutates_args={})
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    lnc = logical_core_size()
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    y = wrap_nki(rms_norm_fwd_kernel)[lnc](x2d, weight.reshape(1, -1).contiguous(), eps, lnc)
    return y.reshape(x.shape)


@nki_op("qwen3_titan_nki::rms_norm_backward", mutates_args={})
def rms_norm_backward_op(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    lnc = logical_core_size()
    dim = x.shape[-1]
    grad_x, grad_w_parts = wrap_nki(rms_norm_bwd_kernel)[lnc](
        grad.reshape(-1, dim).contiguous(),
        x.reshape(-1, dim).contiguous(),
        weight.reshape(1, -1).contiguous(),
        eps,
        lnc,
    )
    return grad_x.reshape(x.shape), grad_w_parts.sum(0).to(weight.dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = rms_norm_backward_op(grad, x, weight, ctx.eps)
    return grad_x, grad_w, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """What the registry hands out: the NKI op on Neuron tensors it fits, else the reference."""
    if on_neuron(x, weight) and fits(x):
        return rms_norm_op(x, weight, eps)
    return torch.ops.qwen3_titan.rms_norm(x, weight, eps)
