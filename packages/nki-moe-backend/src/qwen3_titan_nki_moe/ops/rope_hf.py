"""``qwen3_titan::rope_hf``: rotary embedding in Hugging Face's layout and arithmetic.

``q_BNSH``/``k_BNSH`` are ``[batch, heads, seq, head_dim]`` (k may have fewer heads);
``cos_BSH``/``sin_BSH`` are ``[batch or 1, seq, head_dim]`` with both halves equal, as
transformers' rotary embedding and torchtitan's ``CosSinRoPE`` cache build them::

    q_out = q * cos + rotate_half(q) * sin,    rotate_half(x) = cat(-x2, x1)

The math runs in the inputs' dtype, in transformers' operation order, so the reference
equals ``transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb`` bit for bit; the
NKI kernel (nkilib's ``rope_hf`` contract) also computes in the input dtype. torchtitan's
``CosSinRoPE`` upcasts to fp32 instead: identical in fp32, about one bf16 ulp apart in bf16.
"""

from __future__ import annotations

import torch
from torch import Tensor

NAMESPACE = "qwen3_titan"


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_transposed(x: Tensor) -> Tensor:
    """The adjoint of :func:`rotate_half`: ``cat(x2, -x1)``."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


@torch.library.custom_op(f"{NAMESPACE}::rope_hf", mutates_args=())
def rope_hf(q_BNSH: Tensor, k_BNSH: Tensor, cos_BSH: Tensor, sin_BSH: Tensor) -> tuple[Tensor, Tensor]:
    cos = cos_BSH.unsqueeze(1)
    sin = sin_BSH.unsqueeze(1)
    q_out = (q_BNSH * cos) + (rotate_half(q_BNSH) * sin)
    k_out = (k_BNSH * cos) + (rotate_half(k_BNSH) * sin)
    return q_out, k_out


@rope_hf.register_fake
def _(q_BNSH, k_BNSH, cos_BSH, sin_BSH):
    return torch.empty_like(q_BNSH), torch.empty_like(k_BNSH)


@torch.library.custom_op(f"{NAMESPACE}::rope_hf_backward", mutates_args=())
def rope_hf_backward(
    grad_q_BNSH: Tensor, grad_k_BNSH: Tensor, cos_BSH: Tensor, sin_BSH: Tensor
) -> tuple[Tensor, Tensor]:
    cos = cos_BSH.unsqueeze(1)
    sin = sin_BSH.unsqueeze(1)
    grad_q = (grad_q_BNSH * cos) + rotate_half_transposed(grad_q_BNSH * sin)
    grad_k = (grad_k_BNSH * cos) + rotate_half_transposed(grad_k_BNSH * sin)
    return grad_q, grad_k


@rope_hf_backward.register_fake
def _(grad_q_BNSH, grad_k_BNSH, cos_BSH, sin_BSH):
    return torch.empty_like(grad_q_BNSH), torch.empty_like(grad_k_BNSH)


def _setup_context(ctx, inputs, output) -> None:
    _, _, cos_BSH, sin_BSH = inputs
    ctx.save_for_backward(cos_BSH, sin_BSH)


def _backward(ctx, grad_q, grad_k):
    cos_BSH, sin_BSH = ctx.saved_tensors
    dq, dk = torch.ops.qwen3_titan.rope_hf_backward(grad_q, grad_k, cos_BSH, sin_BSH)
    # cos/sin come from a fixed cache: no gradient.
    return dq, dk, None, None


rope_hf.register_autograd(_backward, setup_context=_setup_context)
