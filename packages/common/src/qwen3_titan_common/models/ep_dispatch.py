"""Expert parallelism off CUDA: a token dispatcher that moves a fixed number of tokens per expert.

torchtitan's ``AllToAllTokenDispatcher`` exchanges as many tokens as each rank routes to each expert: the
sizes are read on the host every layer, and its default path sends them with the list form of
``all_to_all``, which gloo (the CPU) allows only with equal chunks. The Neuron compiler needs fixed shapes
anyway: one graph per shape. :class:`CapacityTokenDispatcher` sends every expert a fixed ``capacity`` of
rows from each rank (``ceil(tokens x top_k / experts x capacity_factor)``, at most the rank's tokens),
zero-filled where fewer are routed, in one equal-split ``all_to_all_single`` each way; so every layer has one
shape on every step and every backend (gloo, Neuron's collectives, NCCL) runs it.

A rank routing more than ``capacity`` tokens to one expert drops the rest (their expert output is zero; the
residual stream carries them, as in Switch Transformers): counted per step and shown in the step line's
``experts:`` figure. ``capacity_factor >= experts / top_k`` never drops (each expert can take every token),
and then the step is the computation one rank does: zero rows cost FLOPs but add nothing, forward or
backward (SwiGLU of a zero row is zero). ``--moe.capacity_factor`` sets it (docs/parallelism.md).

Tensor names follow torchtitan's: T tokens of this rank, K top-k, N = T*K assignments, E experts, e experts
of this rank, C capacity, P expert-parallel ranks, D model width.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed.nn.functional as dist_fn
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    BaseEPTokenDispatcher,
    LocalTokenDispatcher,
)
from torchtitan.ops.scatter_add import deterministic_scatter_add

# Capacity of each expert, in multiples of a balanced load (tokens x top_k / experts): room for an expert
# twice as busy as average before a token is dropped.
DEFAULT_CAPACITY_FACTOR = 2.0


@dataclass(frozen=True, kw_only=True)
class CapacityDispatchMetadata:
    """What ``combine`` needs of ``dispatch``: where each kept assignment went, and its score."""

    token_kept_M: torch.Tensor  # (M,) token index of each kept assignment (M <= N)
    slot_kept_M: torch.Tensor  # (M,) its row in this rank's (E*C, D) send buffer
    score_kept_M: torch.Tensor  # (M,) its routing score
    capacity: int


class CapacityTokenDispatcher(BaseEPTokenDispatcher):
    """Fixed-capacity expert-parallel dispatch (module docstring); with no expert-parallel mesh it is
    torchtitan's local dispatch."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseEPTokenDispatcher.Config):
        capacity_factor: float = DEFAULT_CAPACITY_FACTOR
        """Rows each rank sends each expert, in multiples of a balanced load; >= experts / top_k drops none."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.capacity_factor = config.capacity_factor
        # Assignments dropped over capacity, and routed, since the metrics last took them (take_dropped); a
        # device tensor summed without a host sync (the model is built on the meta device, so not made here).
        self._dropped: torch.Tensor | None = None
        self._assigned = 0

    def capacity(self, tokens: int) -> int:
        balanced = tokens * self.top_k / self.num_experts
        return max(1, min(tokens, math.ceil(balanced * self.capacity_factor)))

    def take_dropped(self) -> tuple[int, int]:
        """(assignments dropped, assignments routed) on this rank since the last call."""
        dropped = int(self._dropped) if self._dropped is not None else 0
        assigned, self._dropped, self._assigned = self._assigned, None, 0
        return dropped, assigned

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        if self.ep_mesh is None:
            return LocalTokenDispatcher.dispatch(
                self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
            )
        T, D = x_TD.shape
        E, P = self.num_experts, self.ep_mesh.size()
        C = self.capacity(T)
        expert_N = topk_expert_ids_TK.reshape(-1)
        order_N = torch.argsort(expert_N, stable=True)
        expert_sorted_N = expert_N[order_N]
        counts_E = num_local_tokens_per_expert_E.to(torch.int64)
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        rank_in_expert_N = torch.arange(order_N.numel(), device=x_TD.device) - starts_E[expert_sorted_N]
        kept_N = rank_in_expert_N < C
        token_kept_M = (order_N // self.top_k)[kept_N]
        slot_kept_M = (expert_sorted_N * C + rank_in_expert_N)[kept_N]
        score_kept_M = topk_scores_TK.reshape(-1)[order_N][kept_N]
        with torch.no_grad():
            dropped = (~kept_N).sum()
            self._dropped = dropped if self._dropped is None else self._dropped + dropped
        self._assigned += expert_N.numel()

        # (E*C, D): expert-major, C rows per expert, zero where fewer are routed to it.
        send_ECD = x_TD.new_zeros(E * C, D).index_copy(0, slot_kept_M, x_TD[token_kept_M])
        received = torch.empty_like(send_ECD)
        # Equal splits: each rank receives C rows per local expert from every rank, source-rank-major.
        received = dist_fn.all_to_all_single(received, send_ECD, group=self.ep_mesh.get_group())
        e = E // P
        routed_RD = received.view(P, e, C, D).transpose(0, 1).reshape(e * P * C, D)
        rows_per_local_expert_e = torch.full((e,), P * C, dtype=counts_E.dtype, device=x_TD.device)
        metadata = CapacityDispatchMetadata(
            token_kept_M=token_kept_M, slot_kept_M=slot_kept_M, score_kept_M=score_kept_M, capacity=C
        )
        return routed_RD, rows_per_local_expert_e, metadata

    def combine(self, routed_output_RD, metadata, x_TD):
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        P, C, D = self.ep_mesh.size(), metadata.capacity, x_TD.shape[-1]
        e = self.num_experts // P
        # Back to source-rank-major, then home: each rank gets its own (E*C, D) rows back.
        back_ECD = routed_output_RD.view(e, P, C, D).transpose(0, 1).reshape(P * e * C, D)
        returned = torch.empty_like(back_ECD)
        returned = dist_fn.all_to_all_single(returned, back_ECD, group=self.ep_mesh.get_group())
        rows_MD = returned[metadata.slot_kept_M]
        # Scores applied in fp32, then the rows added per token in a fixed order: as the local dispatcher does.
        rows_MD = (rows_MD.to(torch.float32) * metadata.score_kept_M.reshape(-1, 1)).to(rows_MD.dtype)
        out_TD = torch.zeros_like(x_TD)
        return deterministic_scatter_add(out_TD, metadata.token_kept_M.reshape(-1, 1).expand(-1, D), rows_MD)


def with_capacity_dispatch(model_config, capacity_factor: float):
    """A copy of ``model_config`` whose all-to-all dispatchers are :class:`CapacityTokenDispatcher`s."""
    model_config = copy.deepcopy(model_config)
    for _, dispatcher, parent, attr in model_config.traverse(AllToAllTokenDispatcher.Config):
        replaced = CapacityTokenDispatcher.Config(
            num_experts=dispatcher.num_experts, top_k=dispatcher.top_k, capacity_factor=capacity_factor
        )
        if isinstance(attr, int):
            parent[attr] = replaced
        else:
            setattr(parent, attr, replaced)
    return model_config
