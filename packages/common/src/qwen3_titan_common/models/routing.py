"""What a Qwen3-MoE's routers chose: kept for the balance loss, counted for the experts' load.

:class:`RecordingTopKRouter` is torchtitan's token-choice router (same gate, same choices, same
parameters, so checkpoints and exports are unchanged) that, when its ``Config.record`` is on and the
model is training, keeps the step's routing probabilities and chosen experts as a
:class:`RoutingRecord`. The balance loss (``components.router_balance``) takes the records of every layer
once per forward (:func:`take_routing`); the hf-v5 backend's model gives its own records from
transformers' router logits through the same ``take_routing`` method.

:func:`router_balance_sums` and :func:`balance_from_sums` are Switch Transformer's auxiliary loss as
transformers' ``load_balancing_loss_func`` computes it for Qwen3-MoE: the top-k assignments and the
routing probabilities of every counted token are summed over *all* layers first, each divided by the
number of token-layer rows, and the loss is ``num_experts * sum_e f_e * P_e``. A balanced router gives
``top_k``. Tokens a mask leaves out (padding) count in neither sum, as transformers leaves out tokens
whose ``attention_mask`` is 0. Written here rather than called from transformers because torchtitan's
router gives probabilities, not logits, and because the global-batch variant needs the sums before the
product.

Per-layer token counts for the step line are ``perf.expert_load``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn as nn
from torchtitan.models.common.moe import TokenChoiceTopKRouter
from torchtitan.protocols.module import Module


class RoutingRecord(NamedTuple):
    """One layer's routing of the tokens of one forward, flattened to ``T = B * L`` rows."""

    probs_TE: torch.Tensor
    """Routing probabilities (softmax over experts), with their autograd history."""

    experts_TK: torch.Tensor
    """The ``top_k`` experts each token was sent to."""


class RecordingTopKRouter(TokenChoiceTopKRouter):
    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        record: bool = False
        """Keep the last training forward's routing for the balance loss (set by ``--moe.router_aux_loss``)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.record = config.record
        self._recorded: RoutingRecord | None = None

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = TokenChoiceTopKRouter.forward(
            self, x_BLD, expert_bias_E
        )
        if self.record and self.training:
            # Overwritten, not appended: activation checkpointing runs this forward again in the backward.
            self._recorded = RoutingRecord(
                scores_BLE.reshape(-1, scores_BLE.shape[-1]),
                topk_expert_ids_BLK.reshape(-1, topk_expert_ids_BLK.shape[-1]),
            )
        return topk_scores_BLK, topk_expert_ids_BLK, scores_BLE

    def take_routing(self) -> list[RoutingRecord]:
        recorded, self._recorded = self._recorded, None
        return [] if recorded is None else [recorded]


def recording_router_config(stock: TokenChoiceTopKRouter.Config) -> RecordingTopKRouter.Config:
    """torchtitan's router config as a :class:`RecordingTopKRouter` config (recording off)."""
    return RecordingTopKRouter.Config(**{f.name: getattr(stock, f.name) for f in fields(stock) if f.init})


def record_routing(model_config) -> int:
    """Switch recording on for every router in a torchtitan model config; returns how many routers."""
    routers = 0
    for _fqn, cfg, _parent, _attr in model_config.traverse(Module.Config, recurse=True):
        if isinstance(cfg, RecordingTopKRouter.Config):
            cfg.record = True
            routers += 1
    return routers


def take_routing(model_parts: Iterable[nn.Module]) -> list[RoutingRecord]:
    """Every layer's record of the last training forward, in layer order, each handed out once."""
    records: list[RoutingRecord] = []
    for part in model_parts:
        for module in part.modules():
            take = getattr(module, "take_routing", None)
            if callable(take):
                records.extend(take())
    return records


class BalanceSums(NamedTuple):
    """The sums the balance loss is a product of, over layers and counted tokens."""

    assignments_E: torch.Tensor
    """Top-k assignments per expert (no gradient)."""

    probs_E: torch.Tensor
    """Routing probability per expert (with gradient)."""

    rows: torch.Tensor
    """Counted token-layer rows (no gradient)."""


def router_balance_sums(records: list[RoutingRecord], counted_T: torch.Tensor | None = None) -> BalanceSums:
    """Sums over ``records`` (one per layer) of the tokens ``counted_T`` marks (all when None)."""
    if not records:
        raise ValueError("router balance loss: no routing was recorded in this forward")
    num_experts = records[0].probs_TE.shape[-1]
    device = records[0].probs_TE.device
    assignments_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    weight_T = None if counted_T is None else counted_T.reshape(-1).to(device=device, dtype=torch.float32)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for probs_TE, experts_TK in records:
        top_k = experts_TK.shape[-1]
        if weight_T is None:
            ones = torch.ones(experts_TK.numel(), dtype=torch.float32, device=device)
            assignments_E = assignments_E.scatter_add(0, experts_TK.reshape(-1), ones)
            probs_E = probs_E + probs_TE.float().sum(dim=0)
            rows = rows + probs_TE.shape[0]
        else:
            assignments_E = assignments_E.scatter_add(
                0, experts_TK.reshape(-1), weight_T.repeat_interleave(top_k)
            )
            probs_E = probs_E + (probs_TE.float() * weight_T.unsqueeze(-1)).sum(dim=0)
            rows = rows + weight_T.sum()
    return BalanceSums(assignments_E.detach(), probs_E, rows.detach())


def balance_from_sums(sums: BalanceSums, local_probs_E: torch.Tensor | None = None) -> torch.Tensor:
    """``num_experts * sum_e (assignments_e / rows) * (probs_e / rows)``.

    ``local_probs_E``: one rank's probability sums when ``sums`` are the whole data-parallel batch's; the
    result is then that rank's share, and the shares of all ranks add up to the whole batch's loss with
    the whole batch's gradient."""
    probs_E = sums.probs_E if local_probs_E is None else local_probs_E
    rows = sums.rows.clamp_min(1.0)  # a batch of padding only counts nothing, and adds no loss
    return probs_E.shape[0] * torch.sum((sums.assignments_E / rows) * (probs_E / rows))


def router_balance_loss(records: list[RoutingRecord], counted_T: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (unscaled) of these records."""
    return balance_from_sums(router_balance_sums(records, counted_T))
