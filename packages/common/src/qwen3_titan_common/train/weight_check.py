"""Non-finite weights found right after a load, named, before a step trains on them.

Cost: one pass over each rank's local shard of the weights already in memory, through ``aminmax``
in chunks (a reduction: no copy of a tensor, nothing more read from disk), plus one all-reduce of
one float per parameter. Measured in docs/performance.md (about 0.3 s per GB of local weights on
one core of the 2-core CPU machine): Qwen3-8B's 16 GB of bf16 is then about 5 s on one CPU rank,
and a fraction of a second per rank on 64 Trainium ranks (250 MB each, at device bandwidth).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

# Elements per reduction: bounds the temporaries a reduction may allocate on any device.
_CHUNK = 1 << 26


def is_finite(tensor: torch.Tensor) -> bool:
    if tensor.numel() == 0 or not tensor.is_floating_point():
        return True
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        low, high = torch.aminmax(flat[start : start + _CHUNK])
        # NaN propagates through min and max; +-Inf is the max or the min itself.
        if not bool(torch.isfinite(low) and torch.isfinite(high)):
            return False
    return True


def first_non_finite(model_parts: list[nn.Module]) -> str | None:
    """The name of the first parameter that holds NaN or Inf on any rank; every rank must call this."""
    names, flags, device = [], [], torch.device("cpu")
    for part in model_parts:
        for name, param in part.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            device = local.device
            names.append(name)
            flags.append(0.0 if is_finite(local) else 1.0)
    if not names:
        return None
    found = torch.tensor(flags, device=device)
    if dist.is_initialized():
        dist.all_reduce(found)  # on the weights' device: the backend the run's process group uses for it
    bad = torch.nonzero(found.cpu()).flatten().tolist()
    return names[bad[0]] if bad else None
