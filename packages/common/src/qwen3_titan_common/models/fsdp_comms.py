"""FSDP2 gradient reduction that gloo can run, so that several CPU ranks train.

torchtitan turns FSDP's gradient division off (it scales the loss by the global token count
itself), so each reduce-scatter is a plain sum in effect; FSDP2 still issues it as
``ReduceOp.PREMUL_SUM``, which gloo does not implement ("Cannot use ReduceOp.PREMUL_SUM with Gloo"
on the first backward of a multi-rank CPU run). Forcing ``SUM`` changes nothing numerically.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def reduces_over_gloo() -> bool:
    """Whether this process's default group is gloo only (CPU ranks)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def use_sum_reduction_on_gloo(model: nn.Module) -> bool:
    """Make every FSDP2 group of ``model`` reduce with ``SUM`` when the ranks talk over gloo.

    Call after the model is sharded. Returns whether anything was changed.
    """
    if not reduces_over_gloo():
        return False
    fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in fsdp_modules:
        module.set_force_sum_reduction_for_comms(True)
    return bool(fsdp_modules)


def reducing_over_gloo_with_sum(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A model spec's ``parallelize_fn`` whose FSDP2 groups reduce with ``SUM`` when the ranks talk over gloo."""

    @wraps(parallelize_fn)
    def parallelize(model: nn.Module, **kwargs) -> nn.Module:
        model = parallelize_fn(model, **kwargs)
        use_sum_reduction_on_gloo(model)
        return model

    return parallelize
