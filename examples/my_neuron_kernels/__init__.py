"""``my_neuron_kernels``: how a user adds a kernel to the nki-moe backend (the recipe's ``rope_hf``).

    PYTHONPATH=examples uv run --package nki-moe-backend train --override.imports my_neuron_kernels

Three pieces, each in its usual place:

1. The op's reference twin, for CPU and CUDA: a ``torch.library.custom_op`` with a fake
   (shape) implementation and an explicit backward (``register_autograd``).
2. The NKI kernel for Trainium, in ``my_neuron_kernels/_nki.py``: an ``@nki.jit`` kernel
   registered with ``torch_neuronx.nki_op`` + ``wrap_nki`` and given the same backward.
   Only the backend's kernel registry imports it, and only on a Neuron host.
3. A module that calls the op through the registry (``registry.get``), and an ``@override``
   factory that puts the module in place of torchtitan's ``CosSinRoPE``.

``registry.register`` makes the registry choose and log the implementation, like the
backend's own ops (``[kernels] my_rope_hf: reference (no Neuron device)``). The backend's
trainer expands the bare module name into its ``@override`` factories (torchtitan 0.3.0 only
takes ``module.function``: ``--override.imports my_neuron_kernels.my_rope_hf`` works too) and
keeps the backend's own MoE and RMSNorm kernels, since this module overrides only RoPE.

The math: with HF's cos/sin (both halves equal), rotating back is rotating by -theta, so the
backward of ``rope(q, cos, sin)`` is ``rope(grad, cos, -sin)``: one kernel does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from qwen3_titan_nki_moe import registry
from torch import Tensor
from torchtitan.config import derive, override
from torchtitan.models.common.rope import CosSinRoPE


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# 1. The reference twin -------------------------------------------------------------------


@torch.library.custom_op("my_neuron_kernels::rope_hf", mutates_args=())
def rope_hf(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q, k: [batch, heads, seq, head_dim]; cos, sin: [batch or 1, seq, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@rope_hf.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q), torch.empty_like(k)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_hf(grad_q, grad_k, cos, -sin)
    return dq, dk, None, None


rope_hf.register_autograd(_backward, setup_context=_setup_context)

# 2. The NKI kernel: my_neuron_kernels/_nki.py, loaded by the registry on Trainium only.
registry.register("my_rope_hf", reference=rope_hf, nki="my_neuron_kernels._nki:rope_hf")


# 3. The module and its @override factory ---------------------------------------------------


class MyRoPE(CosSinRoPE):
    # Its own nested Config, or torchtitan would silently build the parent class.
    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def forward(self, query, key, positions=None):
        # torchtitan passes [B, L, N, H]; the op takes HF's [B, N, L, H] (views, no copies).
        head_dim = query.shape[-1]
        cache = self._reshape_cache(query, positions)[:, :, 0].to(query.dtype)
        q, k = registry.get("my_rope_hf")(
            query.transpose(1, 2), key.transpose(1, 2), cache[..., :head_dim], cache[..., head_dim:]
        )
        return q.transpose(1, 2), k.transpose(1, 2)


@override(target=CosSinRoPE.Config, exact=True, description="my rope_hf kernel (my_neuron_kernels)")
def my_rope_hf(cfg: CosSinRoPE.Config) -> MyRoPE.Config:
    return derive(cfg, MyRoPE.Config)
