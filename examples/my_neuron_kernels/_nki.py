"""The Trainium half of my_neuron_kernels: an NKI rope_hf kernel as a PyTorch op.

Imported by the nki-moe backend's kernel registry only on a Neuron host (it needs the
Neuron SDK's ``nki`` and ``torch_neuronx``). Written for nki 0.7 (Neuron SDK 2.33): plain
``range`` for the static loops (``nl.affine_range`` is deprecated there and means ``range``).
The launch goes through the backend's ``KernelLaunchers``: ``wrap_nki(kernel)[(lnc,)]``, a tuple
grid (one torch-neuronx version rejects a bare int) built once per process (every
``wrap_nki`` call re-traces the kernel). UNTESTED ON HARDWARE: an example written from the
NKI documentation.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
import torch
from qwen3_titan_common.runtime.neuron_env import logical_core_size
from qwen3_titan_nki_moe.kernel_launch import KernelLaunchers
from torch import Tensor
from torch_neuronx import nki_op, wrap_nki

P = 128  # rows per tile: one sequence position per SBUF partition


@nki.jit
def rope_kernel(x, cos, sin, lnc: int):
    """x [B, N, S, H]; cos/sin [Bc, S, H]. Program p of the [lnc] grid takes every lnc-th share of S."""
    batch, heads, seq, head_dim = x.shape
    half = head_dim // 2
    tiles = seq // (P * lnc)
    pid = nl.program_id(0)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    for b in range(batch):
        cb = b if cos.shape[0] > 1 else 0
        for t in range(tiles):
            s0 = (pid * tiles + t) * P
            c = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
            s = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=c, src=cos[cb, nl.ds(s0, P), :])
            nisa.dma_copy(dst=s, src=sin[cb, nl.ds(s0, P), :])
            for n in range(heads):
                xt = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=xt, src=x[b, n, nl.ds(s0, P), :])
                rot = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)  # rotate_half(x)
                nisa.tensor_scalar(
                    dst=rot[:, 0:half], data=xt[:, half:head_dim], op0=nl.multiply, operand0=-1.0
                )
                nisa.tensor_copy(dst=rot[:, half:head_dim], src=xt[:, 0:half])
                xc = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
                rs = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=xc, data1=xt, data2=c, op=nl.multiply)
                nisa.tensor_tensor(dst=rs, data1=rot, data2=s, op=nl.multiply)
                o = nl.ndarray((P, head_dim), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=o, data1=xc, data2=rs, op=nl.add)
                nisa.dma_copy(dst=out[b, n, nl.ds(s0, P), :], src=o)
    return out


_LAUNCHERS = KernelLaunchers(wrap_nki)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    lnc = logical_core_size()  # the grid must match NEURON_LOGICAL_NC_CONFIG
    return _LAUNCHERS(rope_kernel, lnc)(x.contiguous(), cos.contiguous(), sin.contiguous(), lnc)


@nki_op("my_neuron_kernels::rope_hf_nki", mutates_args={})
def rope_hf_nki(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_hf_nki(grad_q, grad_k, cos, -sin)
    return dq, dk, None, None


rope_hf_nki.register_autograd(_backward, setup_context=_setup_context)


def rope_hf(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel where it can run (Neuron tensors, seq a multiple of 128 x LNC), else the reference."""
    if q.device.type == "neuron" and q.shape[2] % (P * logical_core_size()) == 0:
        return rope_hf_nki(q, k, cos, sin)
    return torch.ops.my_neuron_kernels.rope_hf(q, k, cos, sin)
