"""NKI ``rope_hf``: rotary embedding in HF layout, forward and backward in one kernel.

Contract (same as ``qwen3_titan::rope_hf``): ``x`` is ``[B, N, S, H]``, ``cos``/``sin`` are
``[Bc, S, H]`` with ``Bc`` 1 or B. Per 128-row sequence tile, with halves ``x1 | x2``::

    forward:   out1 = x1*cos1 - x2*sin1        out2 = x2*cos2 + x1*sin2
    backward:  dx1  = g1*cos1 + g2*sin2        dx2  = g2*cos2 - g1*sin1

(the backward is ``g*cos + rotate_half^T(g*sin)``). Every product and sum is rounded to the
input dtype, the order transformers' ``apply_rotary_pos_emb`` uses. The grid is ``[LNC]``:
program ``p`` takes the sequence tiles ``p*T .. p*T+T-1`` (``T = S / (128*LNC)``), hence the
rule "seq_len a multiple of 128 x LNC".

UNTESTED ON HARDWARE (see the package docstring).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qwen3_titan_nki_moe.nki._sdk import P, logical_core_size, nisa, nki, nki_op, nl, on_neuron, wrap_nki


@nki.jit
def rope_hf_kernel(x, cos, sin, backward: bool, lnc: int):
    batch, heads, seq, head_dim = x.shape
    half = head_dim // 2
    tiles_per_program = seq // (P * lnc)
    pid = nl.program_id(0)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)

    # Forward multiplies the second half by sin1 and subtracts; backward swaps the sin halves and signs.
    first_sin = slice(half, head_dim) if backward else slice(0, half)
    second_sin = slice(0, half) if backward else slice(half, head_dim)
    first_op = nl.add if backward else nl.subtract
    second_op = nl.subtract if backward else nl.add

    for b in nl.affine_range(batch):
        cb = b if cos.shape[0] > 1 else 0
        for t in nl.affine_range(tiles_per_program):
            s0 = (pid * tiles_per_program + t) * P
            cos_t = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
            sin_t = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=cos_t, src=cos[cb, nl.ds(s0, P), :])
            nisa.dma_copy(dst=sin_t, src=sin[cb, nl.ds(s0, P), :])
            for n in nl.affine_range(heads):
                x_t = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_t, src=x[b, n, nl.ds(s0, P), :])
                a_t = nl.ndarray((P, half), dtype=x.dtype, buffer=nl.sbuf)
                r_t = nl.ndarray((P, half), dtype=x.dtype, buffer=nl.sbuf)
                out_t = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)

                nisa.tensor_tensor(dst=a_t, data1=x_t[:, 0:half], data2=cos_t[:, 0:half], op=nl.multiply)
                nisa.tensor_tensor(
                    dst=r_t, data1=x_t[:, half:head_dim], data2=sin_t[:, first_sin], op=nl.multiply
                )
                nisa.tensor_tensor(dst=out_t[:, 0:half], data1=a_t, data2=r_t, op=first_op)

                nisa.tensor_tensor(
                    dst=a_t, data1=x_t[:, half:head_dim], data2=cos_t[:, half:head_dim], op=nl.multiply
                )
                nisa.tensor_tensor(dst=r_t, data1=x_t[:, 0:half], data2=sin_t[:, second_sin], op=nl.multiply)
                nisa.tensor_tensor(dst=out_t[:, half:head_dim], data1=a_t, data2=r_t, op=second_op)

                nisa.dma_copy(dst=out[b, n, nl.ds(s0, P), :], src=out_t)
    return out


def fits(x: Tensor, cos: Tensor) -> bool:
    """The shapes this kernel takes (the registry's constraints check the same at start)."""
    seq, head_dim = x.shape[-2], x.shape[-1]
    return (
        x.dim() == 4
        and seq % (P * logical_core_size()) == 0
        and head_dim % 2 == 0
        and head_dim <= P
        and cos.shape[-2] == seq
    )


def _launch(x: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tensor:
    lnc = logical_core_size()
    return wrap_nki(rope_hf_kernel)[lnc](x.contiguous(), cos.contiguous(), sin.contiguous(), backward, lnc)


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
    if on_neuron(q, k, cos, sin) and fits(q, cos):
        return rope_hf_op(q, k, cos, sin)
    return torch.ops.qwen3_titan.rope_hf(q, k, cos, sin)
