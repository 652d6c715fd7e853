"""What a run trains and what its optimizer will hold, known before the first step.

torch's optimizers create their state lazily, at the first step; the numbers here come from the
parameters each optimizer was given and the per-element states its algorithm keeps (Adam/AdamW: two
moments, three with ``amsgrad``; SGD: one momentum buffer, none without momentum; Adagrad: one sum),
in the parameter's dtype. One log line at start (``describe_trainable``) is how a LoRA run shows
its saving against full fine-tuning.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

_STATES_PER_ELEMENT = {"Adam": 2, "AdamW": 2, "SGD": 1, "Adagrad": 1, "RMSprop": 1}


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def states_per_element(optimizer: torch.optim.Optimizer) -> int | None:
    """Per-element state tensors ``optimizer`` keeps for a parameter, or None for an algorithm not listed."""
    name = type(optimizer).__name__
    count = _STATES_PER_ELEMENT.get(name)
    if count is None:
        return None
    defaults = optimizer.defaults
    if name in ("Adam", "AdamW") and defaults.get("amsgrad"):
        count += 1
    if name == "SGD" and not defaults.get("momentum"):
        count = 0
    if name == "RMSprop":
        count += int(bool(defaults.get("momentum"))) + int(bool(defaults.get("centered")))
    return count


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int | None:
    """Bytes of per-element optimizer state on this rank (its shards), or None if an algorithm is unknown."""
    total = 0
    for optimizer in optimizers:
        count = states_per_element(optimizer)
        if count is None:
            return None
        for group in optimizer.param_groups:
            for param in group["params"]:
                local = _local(param)
                total += count * local.numel() * local.element_size()
    return total


def describe_trainable(model_parts: Iterable[torch.nn.Module], optimizers) -> str:
    """One line: trainable parameters of how many, and the optimizer state this rank will hold."""
    params = {id(p): p for part in model_parts for p in part.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    state = optimizer_state_bytes(optimizers)
    state_text = (
        "unknown (optimizer not listed)" if state is None else f"{state:,} bytes ({state / 2**20:.2f} MiB)"
    )
    return (
        f"[params] trainable {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.2f}%); "
        f"optimizer state per rank {state_text}"
    )
