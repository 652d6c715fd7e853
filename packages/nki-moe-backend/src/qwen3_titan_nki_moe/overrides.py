"""``@override`` factories that route torchtitan's Qwen3-MoE modules through the kernel registry.

    --override.imports qwen3_titan_nki_moe.overrides.grouped_experts   routed experts -> grouped_swiglu
    --override.imports qwen3_titan_nki_moe.overrides.rope_hf           CosSinRoPE     -> rope_hf
    --override.imports qwen3_titan_nki_moe.overrides.rms_norm          RMSNorm        -> rms_norm

(the backend's config functions list all three; ``--override.imports qwen3_titan_nki_moe.overrides``,
the bare module, means the same under this backend's trainer). Each replacement subclasses
the stock module and declares its own nested ``Config``: torchtitan binds ``Config`` to the
class that declares it, so without one ``derive`` would silently build the parent. The
stock parameters (``w1_EFD``, ``w2_EDF``, ``w3_EFD``, ``weight``) and buffers are inherited
unchanged, so state dicts, the HF state-dict adapter and checkpoints are unaffected.

Each replacement ``Config`` also carries the kernel mode (``kernels``) and the run's
:class:`~qwen3_titan_nki_moe.constraints.KernelShape` (``kernel_shape``, for the NKI shape
rules): the factories take both as keyword arguments, which torchtitan forwards from an
``override.imports`` entry ``(factory, {"kernels": ..., "kernel_shape": ...})``; the backend's
trainer writes ``--kernels`` into those entries. A module chooses its implementation once, in
``__init__`` (``registry.choose``), and calls it directly in ``forward``: two modules built
with different modes each keep their own.

Inputs that are DTensors (tensor/context parallel activations) take the stock code path:
the custom ops have no DTensor sharding rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.config import derive, override
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.rope import CosSinRoPE

from qwen3_titan_nki_moe import registry
from qwen3_titan_nki_moe.constraints import KernelShape
from qwen3_titan_nki_moe.registry import KernelMode

# The factories, as --override.imports names them (config functions list these).
KERNEL_OVERRIDES = (
    "qwen3_titan_nki_moe.overrides.grouped_experts",
    "qwen3_titan_nki_moe.overrides.rope_hf",
    "qwen3_titan_nki_moe.overrides.rms_norm",
)


def _local(weight: torch.Tensor) -> torch.Tensor:
    # Under EP the experts get a variable number of tokens, which DTensor cannot express.
    return weight.to_local() if isinstance(weight, DTensor) else weight


class RegistryGroupedExperts(GroupedExperts):
    """``GroupedExperts`` whose SwiGLU MLP is the registry's ``grouped_swiglu`` op.

    The GEMMs run in the activations' dtype (the weights are cast to it), like common's
    ``ActivationDtypeGroupedExperts`` that the backend's model spec uses: under FSDP mixed
    precision both are bf16, as in torchtitan's stock ``GroupedExperts``; in an fp32 run
    they stay fp32 where the stock module would drop to bf16.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        kernels: KernelMode = "auto"
        """The kernel mode (``registry``); the backend's trainer sets it from ``--kernels``."""
        kernel_shape: KernelShape | None = None
        """The run's shapes, for the NKI shape rules; None checks none."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.kernel = registry.choose("grouped_swiglu", config.kernels, config.kernel_shape)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        dtype = x_RD.dtype
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        return self.kernel.fn(
            x_RD,
            _local(self.w1_EFD).to(dtype),
            _local(self.w3_EFD).to(dtype),
            _local(self.w2_EDF).to(dtype),
            offsets_E,
        )


class RegistryRoPE(CosSinRoPE):
    """``CosSinRoPE`` applied by the registry's ``rope_hf`` op (HF layout, input-dtype math).

    torchtitan's attention hands over token-major ``[B, L, N, H]`` tensors; the op takes
    transformers' ``[B, N, L, H]``, so we pass transposed views in and out (no copies).
    The cos/sin cache, its positions handling and its buffer are the parent's.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        kernels: KernelMode = "auto"
        """The kernel mode (``registry``); the backend's trainer sets it from ``--kernels``."""
        kernel_shape: KernelShape | None = None
        """The run's shapes, for the NKI shape rules; None checks none."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.kernel = registry.choose("rope_hf", config.kernels, config.kernel_shape)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(query, DTensor):
            return super().forward(query, key, positions)
        head_dim = query.shape[-1]
        cache_BL1X = self._reshape_cache(query, positions)  # (1 or B, L, 1, 2 * head_dim)
        cache_BLX = cache_BL1X[:, :, 0].to(query.dtype)
        cos_BLH, sin_BLH = cache_BLX[..., :head_dim], cache_BLX[..., head_dim:]
        q_BNLH, k_BNLH = self.kernel.fn(query.transpose(1, 2), key.transpose(1, 2), cos_BLH, sin_BLH)
        return q_BNLH.transpose(1, 2), k_BNLH.transpose(1, 2)


class RegistryRMSNorm(RMSNorm):
    """torchtitan's ``RMSNorm`` computed by the registry's ``rms_norm`` op."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        kernels: KernelMode = "auto"
        """The kernel mode (``registry``); the backend's trainer sets it from ``--kernels``."""
        kernel_shape: KernelShape | None = None
        """The run's shapes, for the NKI shape rules; None checks none."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.kernel = registry.choose("rms_norm", config.kernels, config.kernel_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or len(self.normalized_shape) != 1 or isinstance(x, DTensor):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return self.kernel.fn(x, self.weight, eps)


@override(
    target=GroupedExperts.Config,
    description="routed experts' SwiGLU MLP through the kernel registry (grouped_swiglu)",
)
def grouped_experts(
    cfg: GroupedExperts.Config, *, kernels: KernelMode = "auto", kernel_shape: KernelShape | None = None
) -> RegistryGroupedExperts.Config:
    # Not exact: also claims subclasses such as common's ActivationDtypeGroupedExperts.
    return derive(cfg, RegistryGroupedExperts.Config, kernels=kernels, kernel_shape=kernel_shape)


@override(
    target=CosSinRoPE.Config,
    exact=True,
    description="rotary embedding through the kernel registry (rope_hf)",
)
def rope_hf(
    cfg: CosSinRoPE.Config, *, kernels: KernelMode = "auto", kernel_shape: KernelShape | None = None
) -> RegistryRoPE.Config:
    return derive(cfg, RegistryRoPE.Config, kernels=kernels, kernel_shape=kernel_shape)


@override(
    target=RMSNorm.Config,
    exact=True,
    description="RMSNorm through the kernel registry (rms_norm)",
)
def rms_norm(
    cfg: RMSNorm.Config, *, kernels: KernelMode = "auto", kernel_shape: KernelShape | None = None
) -> RegistryRMSNorm.Config:
    return derive(cfg, RegistryRMSNorm.Config, kernels=kernels, kernel_shape=kernel_shape)
