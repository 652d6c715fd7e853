"""Expert parallelism off CUDA: token dispatchers that gloo (the CPU) and Neuron's compiler run.

torchtitan's ``AllToAllTokenDispatcher`` exchanges as many tokens as each rank routes to each expert: the
sizes are read on the host every layer, and on its default ``spmd_types`` path it sends them with
``spmd_types.all_to_all``, which gloo does not run. Two dispatchers of ours:

- :class:`ExactTokenDispatcher` (the CPU's default) is torchtitan's, exchanging exactly the routed rows, with
  its three exchanges through torch's public ``all_to_all_single`` with split sizes, which gloo runs forward
  and backward. It drops nothing, so expert parallelism trains what one rank trains.
- The Neuron compiler needs fixed shapes: one graph per shape. :class:`CapacityTokenDispatcher` sends every
expert a fixed ``capacity`` of rows from each rank (``ceil(tokens x top_k / experts x capacity_factor)``, at most the rank's tokens),
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
import torch.distributed as dist
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    BaseEPTokenDispatcher,
    LocalTokenDispatcher,
)
from torchtitan.ops.scatter_add import deterministic_scatter_add

from qwen3_titan_common.compat import in_recomputed_forward

# Capacity of each expert, in multiples of a balanced load (tokens x top_k / experts): room for an expert
# twice as busy as average before a token is dropped.
DEFAULT_CAPACITY_FACTOR = 2.0


@dataclass(frozen=True, kw_only=True)
class CapacityDispatchMetadata:
    """What ``combine`` needs of ``dispatch``: where each assignment went, and its score."""

    token_N: torch.Tensor  # (N,) token index of each assignment, in expert order
    slot_N: torch.Tensor  # (N,) its row in this rank's (E*C, D) send buffer; E*C where it was dropped
    score_N: torch.Tensor  # (N,) its routing score
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
        # Assignments dropped over capacity in each forward, and routed, since the metrics last took them
        # (take_dropped): device tensors summed there, without a host sync here.
        self._dropped: list[torch.Tensor] = []
        self._assigned = 0

    def capacity(self, tokens: int) -> int:
        balanced = tokens * self.top_k / self.num_experts
        return max(1, min(tokens, math.ceil(balanced * self.capacity_factor)))

    def take_dropped(self) -> tuple[int, int]:
        """(assignments dropped, assignments routed) on this rank since the last call."""
        dropped = int(sum(self._dropped)) if self._dropped else 0
        assigned, self._dropped, self._assigned = self._assigned, [], 0
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
        N = expert_N.numel()
        order_N = torch.argsort(expert_N, stable=True)
        expert_sorted_N = expert_N[order_N]
        counts_E = num_local_tokens_per_expert_E.to(torch.int64)
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        rank_in_expert_N = torch.arange(N, device=x_TD.device) - starts_E[expert_sorted_N]
        kept_N = rank_in_expert_N < C
        token_N = order_N // self.top_k
        # Fixed shapes throughout (Neuron compiles one graph; torch's memory tracker follows fake tensors): a
        # dropped assignment is written to a row of its own past the E*C that are sent, and reads back zeros.
        slot_N = torch.where(
            kept_N, expert_sorted_N * C + rank_in_expert_N, E * C + torch.arange(N, device=x_TD.device)
        )
        with torch.no_grad():
            dropped = (~kept_N).sum()  # in the recomputed forward too: selective recomputation counts the ops
        # Training forwards only, once each: not validation's (no gradients), nor activation checkpointing's
        # recomputation in the backward, which routes the same tokens again.
        if torch.is_grad_enabled() and not in_recomputed_forward():
            self._dropped.append(dropped)
            self._assigned += N

        # (E*C, D): expert-major, C rows per expert, zero where fewer are routed to it.
        send_ECD = x_TD.new_zeros(E * C + N, D).index_copy(0, slot_N, x_TD[token_N])[: E * C]
        # Equal splits: each rank receives C rows per local expert from every rank, source-rank-major.
        e = E // P
        equal = [e * C] * P
        received = exchange_rows(send_ECD, equal, equal, self.ep_mesh.get_group())
        routed_RD = received.view(P, e, C, D).transpose(0, 1).reshape(e * P * C, D)
        rows_per_local_expert_e = torch.full((e,), P * C, dtype=counts_E.dtype, device=x_TD.device)
        metadata = CapacityDispatchMetadata(
            token_N=token_N,
            slot_N=slot_N.clamp(max=E * C),
            score_N=topk_scores_TK.reshape(-1)[order_N],
            capacity=C,
        )
        return routed_RD, rows_per_local_expert_e, metadata

    def combine(self, routed_output_RD, metadata, x_TD):
        if self.ep_mesh is None:
            return LocalTokenDispatcher.combine(self, routed_output_RD, metadata, x_TD)
        P, C, D = self.ep_mesh.size(), metadata.capacity, x_TD.shape[-1]
        e = self.num_experts // P
        # Back to source-rank-major, then home: each rank gets its own (E*C, D) rows back.
        back_ECD = routed_output_RD.view(e, P, C, D).transpose(0, 1).reshape(P * e * C, D)
        equal = [e * C] * P
        returned = exchange_rows(back_ECD, equal, equal, self.ep_mesh.get_group())
        # A dropped assignment's slot (E*C) reads the zero row appended.
        rows_ND = torch.cat([returned, returned.new_zeros(1, D)])[metadata.slot_N]
        # Scores applied in fp32, then the rows added per token in a fixed order: as the local dispatcher does.
        rows_ND = (rows_ND.to(torch.float32) * metadata.score_N.reshape(-1, 1)).to(rows_ND.dtype)
        out_TD = torch.zeros_like(x_TD)
        return deterministic_scatter_add(out_TD, metadata.token_N.reshape(-1, 1).expand(-1, D), rows_ND)


def _all_to_all(
    rows_XD: torch.Tensor, output_splits: list[int], input_splits: list[int], group
) -> torch.Tensor:
    received_YD = rows_XD.new_empty(sum(output_splits), *rows_XD.shape[1:])
    dist.all_to_all_single(
        received_YD,
        rows_XD.contiguous(),
        output_split_sizes=output_splits,
        input_split_sizes=input_splits,
        group=group,
    )
    return received_YD


class _ExchangeRows(torch.autograd.Function):
    """Rows to and from every rank: ``input_splits[r]`` rows sent to rank r, ``output_splits[r]`` received from
    it, in rank order; the backward sends the gradients back the same way.

    Hand-written because torch 2.14 deprecates its public autograd all-to-all
    (``torch.distributed.nn.functional.all_to_all_single``, which warns at every call) in favour of a private
    one; the collective is torch's public ``all_to_all_single``, which takes uneven splits on gloo and NCCL."""

    @staticmethod
    def forward(ctx, rows_XD, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(rows_XD, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_YD):
        output_splits, input_splits = ctx.splits
        # The forward's exchange reversed: each rank's gradients go back to the rank that sent the rows.
        return _all_to_all(grad_YD, input_splits, output_splits, ctx.group), None, None, None


def exchange_rows(rows_XD: torch.Tensor, output_splits, input_splits, group) -> torch.Tensor:
    """:class:`_ExchangeRows`: ``rows_XD`` sent ``input_splits[r]`` rows to rank r; what arrives, in rank order."""
    return _ExchangeRows.apply(rows_XD, list(output_splits), list(input_splits), group)


class ExactTokenDispatcher(AllToAllTokenDispatcher):
    """torchtitan's exchange of exactly the routed rows, through collectives gloo runs (module docstring).

    Only the exchanges are ours: torchtitan splits them out of ``dispatch`` and ``combine`` as hooks (its graph
    passes wrap them), so the reordering, the scores and the sums are torchtitan's own."""

    @dataclass(kw_only=True, slots=True)
    class Config(AllToAllTokenDispatcher.Config):
        pass

    def _token_count_exchange(self, num_local_tokens_per_expert_E, pg, ep_size):
        # (P, e): how many rows each rank sends each of this rank's experts.
        counts_Pe = num_local_tokens_per_expert_E.reshape(ep_size, -1).contiguous()
        received_Pe = torch.empty_like(counts_Pe)
        dist.all_to_all_single(received_Pe, counts_Pe, group=self.ep_mesh.get_group())
        return received_Pe

    def _dispatch_token_exchange(self, routed_input_ND, pg, output_splits, input_splits):
        return exchange_rows(routed_input_ND, output_splits, input_splits, self.ep_mesh.get_group())

    def _combine_token_exchange(self, routed_output_RD, pg, input_splits, output_splits):
        # The dispatch's exchange reversed: send what was received, receive what was sent.
        return exchange_rows(routed_output_RD, input_splits, output_splits, self.ep_mesh.get_group())


def with_token_dispatcher(model_config, capacity_factor: float | None):
    """A copy of ``model_config`` whose all-to-all dispatchers are ours: :class:`CapacityTokenDispatcher`s with
    ``capacity_factor``, or :class:`ExactTokenDispatcher`s where it is None."""
    model_config = copy.deepcopy(model_config)
    for _, dispatcher, parent, attr in model_config.traverse(AllToAllTokenDispatcher.Config):
        if capacity_factor is None:
            replaced = ExactTokenDispatcher.Config(num_experts=dispatcher.num_experts, top_k=dispatcher.top_k)
        else:
            replaced = CapacityTokenDispatcher.Config(
                num_experts=dispatcher.num_experts, top_k=dispatcher.top_k, capacity_factor=capacity_factor
            )
        if isinstance(attr, int):
            parent[attr] = replaced
        else:
            setattr(parent, attr, replaced)
    return model_config
