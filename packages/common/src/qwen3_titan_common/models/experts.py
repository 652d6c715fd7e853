"""Routed experts that compute in the activations' dtype.

torchtitan 0.3.0's ``GroupedExperts`` casts every expert GEMM to bf16, even in an
fp32 run, so an fp32 torchtitan Qwen3-MoE cannot match transformers (or itself in
bf16 vs fp32) beyond bf16 precision. Under mixed precision the activations arrive
in bf16 anyway (FSDP's param dtype), so computing in ``x_RD.dtype`` changes nothing
there and makes fp32 runs exact. Parameter names and shapes are the stock ones, so
checkpoints and torchtitan's state-dict adapter are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts


def _local(weight: torch.Tensor) -> torch.Tensor:
    # EP hands variable token counts to the GEMM, which DTensor cannot express.
    return weight.to_local() if isinstance(weight, DTensor) else weight


class ActivationDtypeGroupedExperts(GroupedExperts):
    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        dtype = x_RD.dtype
        w1_EFD = _local(self.w1_EFD).to(dtype)
        w2_EDF = _local(self.w2_EDF).to(dtype)
        w3_EFD = _local(self.w3_EFD).to(dtype)
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        gate_RF = self._grouped_mm(A=x_RD, B_t=w1_EFD.transpose(-2, -1), offs=offsets_E)
        up_RF = self._grouped_mm(A=x_RD, B_t=w3_EFD.transpose(-2, -1), offs=offsets_E)
        h_RF = F.silu(gate_RF) * up_RF
        return self._grouped_mm(A=h_RF, B_t=w2_EDF.transpose(-2, -1), offs=offsets_E)
