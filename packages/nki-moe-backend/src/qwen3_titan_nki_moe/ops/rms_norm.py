"""``qwen3_titan::rms_norm``: RMSNorm over the last dimension with a weight.

``y = x / sqrt(mean(x**2, -1) + eps) * weight``. The reference forward is
``torch.rms_norm`` (what torchtitan's ``RMSNorm``, an ``nn.RMSNorm``, calls), so swapping
the module changes no forward bit; the backward is written out (statistics in fp32 for
half-precision inputs, like the forward) and is also what the NKI backward kernel computes.
"""

from __future__ import annotations

import torch
from torch import Tensor

NAMESPACE = "qwen3_titan"


def _opmath(t: Tensor) -> Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x_f = _opmath(x)
    rstd = torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x_f * rstd
    grad_f = _opmath(grad)
    grad_x_hat = grad_f * _opmath(weight)
    grad_x = rstd * (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True))
    grad_weight = (grad_f * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad, x, weight, eps):
    return torch.empty_like(x), torch.empty_like(weight)


def register_rms_norm_autograd(forward_op, backward_op) -> None:
    """``forward_op(x, weight, eps)``'s autograd: ``backward_op(grad, x, weight, eps) -> (grad_x, grad_weight)``.

    The reference op and the NKI kernel share it: only their backward op differs.
    """

    def setup_context(ctx, inputs, output) -> None:
        x, weight, eps = inputs
        ctx.save_for_backward(x, weight)
        ctx.eps = eps

    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = backward_op(grad, x, weight, ctx.eps)
        return grad_x, grad_weight, None

    forward_op.register_autograd(backward, setup_context=setup_context)


register_rms_norm_autograd(rms_norm, torch.ops.qwen3_titan.rms_norm_backward)
