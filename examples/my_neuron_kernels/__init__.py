"""``my_neuron_kernels``: how a user adds a kernel to the nki-moe backend (the recipe's ``rope_hf``).

    PYTHONPATH=examples uv run --package nki-moe-backend train --override.imports my_neuron_kernels

Three pieces, each in its usual place:

1. The op's reference twin, for CPU and CUDA: a ``torch.library.custom_op`` with a fake
   (shape) implementation and an explicit backward (``register_autograd``).
2. The NKI kernel for Trainium, in ``my_neuron_kernels/_nki.py``: an ``@nki.jit`` kernel
   registered with ``torch_neuronx.nki_op`` + ``wrap_nki`` and given the same backward.
   Only the backend's kernel registry imports it, and only on a Neuron host.
3. A module whose ``Config`` carries the kernel mode (``kernels``, ``kernel_shape``) and that
   chooses its implementation once, when built (``registry.choose``), and an ``@override``
   factory that puts the module in place of torchtitan's ``CosSinRoPE``. The factory takes
   the mode as keyword arguments: the backend's trainer passes ``--kernels`` to every factory
   that declares them, through torchtitan's ``override.imports`` entry kwargs.

``registry.register`` adds the op to the backend's table, so the trainer logs its choice like
the backend's own ops (``[kernels] my_rope_hf: reference (no Neuron device)``). The backend's
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
from qwen3_titan_nki_moe.constraints import KernelShape
from qwen3_titan_nki_moe.registry import KernelMode
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
        kernels: KernelMode = "auto"  # set from --kernels by the backend's trainer
        kernel_shape: KernelShape | None = None  # the run's shapes, for the NKI shape rules

    def __init__(self, config: Config):
        super().__init__(config)
        # Chosen once here; forward calls it with no lookup.
        self.kernel = registry.choose("my_rope_hf", config.kernels, config.kernel_shape)

    def forward(self, query, key, positions=None):
        # torchtitan passes [B, L, N, H]; the op takes HF's [B, N, L, H] (views, no copies).
        head_dim = query.shape[-1]
        cache = self._reshape_cache(query, positions)[:, :, 0].to(query.dtype)
        q, k = self.kernel.fn(
            query.transpose(1, 2), key.transpose(1, 2), cache[..., :head_dim], cache[..., head_dim:]
        )
        return q.transpose(1, 2), k.transpose(1, 2)


@override(target=CosSinRoPE.Config, exact=True, description="my rope_hf kernel (my_neuron_kernels)")
def my_rope_hf(
    cfg: CosSinRoPE.Config, *, kernels: KernelMode = "auto", kernel_shape: KernelShape | None = None
) -> MyRoPE.Config:
    return derive(cfg, MyRoPE.Config, kernels=kernels, kernel_shape=kernel_shape)
