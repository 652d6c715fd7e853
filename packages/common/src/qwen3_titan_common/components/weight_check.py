"""Non-finite weights found right after a load, named, before a step trains on them.

Cost: one pass over each rank's local shard of the weights already in memory, through ``aminmax``
in chunks (reductions: no copy of a tensor, nothing more read from disk), one all-reduce of one float
per parameter, and one device-to-host copy of those flags (no per-tensor sync; on Trainium the
reductions form one graph, compiled once and cached like the training step's). Measured on one thread
of the 2-core CPU machine: 0.5 s per GiB of bf16 (docs/performance.md), so Qwen3-8B's 15.3 GiB is
about 7 s on a single CPU rank; split across 64 Trainium ranks it is 240 MiB each at device bandwidth.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

# Elements per reduction: bounds the temporaries a reduction may allocate on any device.
_CHUNK = 1 << 26


def _non_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor on ``tensor``'s device: 1.0 if it holds NaN or Inf (no host sync)."""
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return torch.zeros((), device=tensor.device)
    flat = tensor.detach().reshape(-1)
    # NaN propagates through min and max; +-Inf is the max or the min itself.
    ends = torch.stack(
        [torch.stack(torch.aminmax(flat[i : i + _CHUNK])) for i in range(0, flat.numel(), _CHUNK)]
    )
    return (~torch.isfinite(ends).all()).float()


def is_finite(tensor: torch.Tensor) -> bool:
    return not bool(_non_finite(tensor))


def first_non_finite(model_parts: list[nn.Module]) -> str | None:
    """The name of the first parameter that holds NaN or Inf on any rank; every rank must call this.

    Ranks may hold different parameters (pipeline stages): the flags are reduced on each rank, one flag
    crosses the ranks, and only when it is raised do the ranks exchange the names they found."""
    names, flags = [], []
    for part in model_parts:
        for name, param in part.named_parameters():
            names.append(name)
            flags.append(_non_finite(param.to_local() if isinstance(param, DTensor) else param))
    found = torch.stack(flags) if flags else torch.zeros(0)
    if dist.is_initialized():
        # A shard of a weight may be finite on one rank and not on another: the flag of any rank counts.
        anywhere = found.max().reshape(1) if flags else torch.zeros(1)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)  # on the weights' device: the run's backend for it
        if not bool(anywhere.item()):
            return None
    local = torch.nonzero(found.cpu()).flatten().tolist()
    first = names[local[0]] if local else None
    if not dist.is_initialized():
        return first
    everyone: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, first)
    return next(name for name in everyone if name is not None)  # the flag came from some rank's own name
