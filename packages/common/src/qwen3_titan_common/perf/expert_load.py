"""The experts' load of an MoE run, from the per-layer token counts its model keeps.

The step line shows two figures per stretch of steps (``components.metrics``), TensorBoard one pair per layer;
a model offers its counts with ``take_expert_counts() -> ExpertCounts | None`` (native and nki-moe:
torchtitan's own ``MoE.tokens_per_expert_E``; hf-v5: counted from transformers' router logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torchtitan.tools import utils as titan_utils


class ExpertCounts(NamedTuple):
    """A model's per-layer token counts per expert (each token counted once per expert it was sent to)."""

    top_k: int
    by_layer: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ExpertLoad:
    """One layer's routing over a stretch of steps."""

    layer: str
    busiest_share: float
    """The share of the layer's routed tokens that its busiest expert took (balanced: top_k / num_experts)."""

    idle_experts: int
    """Experts that took no token."""

    balanced_share: float


def expert_load(counts_by_layer: dict[str, torch.Tensor], top_k: int) -> list[ExpertLoad]:
    """Per layer, from its per-expert token-assignment counts (each token counts once per chosen expert)."""
    loads = []
    for layer, counts_E in counts_by_layer.items():
        counts_E = counts_E.detach().float().cpu()
        tokens = float(counts_E.sum()) / top_k
        busiest = float(counts_E.max()) / tokens if tokens > 0 else 0.0
        loads.append(
            ExpertLoad(
                layer=layer,
                busiest_share=busiest,
                idle_experts=int((counts_E == 0).sum()) if tokens > 0 else 0,
                balanced_share=top_k / counts_E.numel(),
            )
        )
    return loads


COLLAPSE_TIMES_BALANCED = 4
COLLAPSE_SHARE_RANGE = (0.5, 0.9)


def collapsed(load: ExpertLoad, num_experts: int) -> bool:
    """A layer's routing has collapsed when its busiest expert takes 4x its balanced share of the tokens
    (kept within 50%..90%: at least half the tokens, and reachable when 4x would be all of them), or when
    at least half its experts take none."""
    low, high = COLLAPSE_SHARE_RANGE
    threshold = min(high, max(low, COLLAPSE_TIMES_BALANCED * load.balanced_share))
    return load.busiest_share >= threshold or load.idle_experts >= num_experts / 2


def all_ranks_counts(model_parts, parallel_dims) -> ExpertCounts | None:
    """The model's per-layer expert counts since the last call, summed over the ranks that route other tokens,
    and with every pipeline stage's layers (a collective: every rank calls it); None for a dense model."""
    counts: dict[str, torch.Tensor] = {}
    top_k = 0
    for part in model_parts or ():
        take = getattr(part, "take_expert_counts", None)
        taken = take() if callable(take) else None
        if taken is not None:
            top_k = taken.top_k
            counts.update(taken.by_layer)
    if parallel_dims.pp_enabled:
        top_k, counts = _every_stage(top_k, counts, parallel_dims.get_mesh("pp").get_group())
    if not counts:
        return None
    names = list(counts)
    stacked_LE = _summed_over_token_ranks(torch.stack([counts[n] for n in names]), parallel_dims)
    return ExpertCounts(top_k, dict(zip(names, stacked_LE, strict=True)))


def _every_stage(top_k: int, counts: dict[str, torch.Tensor], group) -> tuple[int, dict[str, torch.Tensor]]:
    """Every pipeline stage's layer counts on every stage (a collective over the pipeline ranks, called by each
    whether its stage holds MoE layers or none). Layers are named by their index in the model, as both
    backends' decoders name them; a stage's zero rows for another stage's layers (hf-v5 counts every layer) add
    nothing."""
    device = titan_utils.device_type
    layers = max((int(name) + 1 for name in counts), default=0)
    experts = max((row.numel() for row in counts.values()), default=0)
    sizes = torch.tensor([layers, experts, top_k], dtype=torch.int64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    layers, experts, top_k = sizes.tolist()
    if layers == 0:
        return 0, {}
    # One row per layer of the model, and which rows some stage holds.
    counts_LE = torch.zeros(layers, experts, dtype=torch.int64, device=device)
    held_L = torch.zeros(layers, dtype=torch.int64, device=device)
    for name, row in counts.items():
        counts_LE[int(name)] = row.to(device=device, dtype=torch.int64)
        held_L[int(name)] = 1
    dist.all_reduce(counts_LE, group=group)
    dist.all_reduce(held_L, group=group)
    return top_k, {str(layer): counts_LE[layer] for layer in range(layers) if held_L[layer]}


def _summed_over_token_ranks(tensor: torch.Tensor, parallel_dims) -> torch.Tensor:
    """``tensor`` summed over the ranks that route other tokens, as torchtitan's own load-balancing hook sums
    its counts: the tensor-parallel ranks of an expert-parallel run, then the data- and context-parallel ones."""
    if parallel_dims.ep_enabled and parallel_dims.tp > 1:
        dist.all_reduce(tensor, group=parallel_dims.get_mesh("tp").get_group())
    loss_mesh = parallel_dims.get_optional_mesh("loss") if parallel_dims.dp_cp_enabled else None
    if loss_mesh is not None:
        dist.all_reduce(tensor, group=loss_mesh.get_group())
    return tensor


def dropped_assignments(model_parts, parallel_dims) -> tuple[int, int]:
    """(assignments dropped over capacity, assignments routed) since the last call, over every rank that routes
    other tokens (a collective: every rank calls it), from the dispatchers that drop (``models.ep_dispatch``:
    they offer ``take_dropped``); (0, 0) where none does."""
    dropped = routed = 0
    for part in model_parts or ():
        for module in part.modules():
            take = getattr(getattr(module, "token_dispatcher", None), "take_dropped", None)
            if callable(take):
                d, r = take()
                dropped, routed = dropped + d, routed + r
    # On the device the run's collectives use (torchtitan's device type, as its meshes are built on).
    totals = torch.tensor([dropped, routed], dtype=torch.int64, device=titan_utils.device_type)
    totals = _summed_over_token_ranks(totals, parallel_dims)
    if parallel_dims.pp_enabled:
        # Each stage's dispatchers count the assignments of its own layers.
        dist.all_reduce(totals, group=parallel_dims.get_mesh("pp").get_group())
    dropped, routed = totals.tolist()
    return int(dropped), int(routed)
