"""Warnings that cannot apply to the run at hand, each turned off where it starts, inside a rank.

Called by the trainer before torchtitan builds anything. Each function checks the condition under which
its warning says nothing about this run and acts only then, so the same warning still reaches a run it
applies to. The others are handled where they start, by config values and checks before the call:
CUDA graphs (``Trainer.resolve_cuda_graphs``), ``initial_load_model_only`` (``Qwen3CheckpointManager.Config``), the
tokenizer folder's missing shard index (``models.qwen3``'s state-dict adapter), the CPU's peak FLOPs
(``compat``'s CPU device).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

# torchrun sets it (to 1) for every rank; torchtitan replaces it with 3 and warns that it does.
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_DTENSOR_RNG_ON_CPU = "DTensor random operators may not have complete support on cpu device mesh"
_SET_VITAL = "'set_vital' is deprecated, please do not call"
_CPU_AUTOCAST_DTYPE = "In CPU autocast, but the target dtype is not supported"


def drop_nccl_settings_on_gloo(device_type: str, env: MutableMapping[str, str] = os.environ) -> bool:
    """A gloo run (the CPU) has no NCCL: torchrun's NCCL setting means nothing to it, and torchtitan's
    warning about replacing it would be the only line it prints."""
    if device_type != "cpu" or NCCL_ASYNC_ERROR_HANDLING not in env:
        return False
    del env[NCCL_ASYNC_ERROR_HANDLING]
    return True


def quiet_dtensor_rng_on_one_cpu_rank(device_type: str, world_size: int) -> bool:
    """DTensor warns that its random ops may not keep ranks in step on a CPU mesh (it has no CPU RNG
    tracker). With one rank there is nothing to keep in step: the initialisation draws the same numbers as
    on an undistributed model. With several CPU ranks the warning applies and stays."""
    if device_type != "cpu" or world_size != 1:
        return False
    warnings.filterwarnings("ignore", message=re.escape(_DTENSOR_RNG_ON_CPU), category=UserWarning)
    return True


def quiet_torchdata_set_vital() -> None:
    """torchdata 0.11's ``StatefulDataLoader.__init__`` calls ``torch.set_vital``, which torch 2.14 turned
    into a no-op that warns; the call does nothing and nobody running a model can act on it. Only that
    message from torchdata is ignored (``tests`` check that torchdata still makes the call)."""
    warnings.filterwarnings(
        "ignore", message=re.escape(_SET_VITAL), category=UserWarning, module=r"torchdata(\.|$)"
    )


def quiet_router_autocast_on_cpu(device_type: str) -> bool:
    """torchtitan's MoE router computes its scores under ``torch.autocast(dtype=torch.float32)``, which the CPU's
    autocast does not take: torch then runs the block without autocast and warns at every router. On the CPU
    nothing is lost by that: a run in fp32 computes the scores in fp32 anyway, and a bf16 one autocasts only a
    dense model trained whole (``models.fsdp_comms``), never a MoE. Elsewhere the warning stays."""
    if device_type != "cpu":
        return False
    warnings.filterwarnings(
        "ignore", message=re.escape(_CPU_AUTOCAST_DTYPE), category=UserWarning, module=r"torchtitan\.models\."
    )
    return True


def quiet_what_does_not_apply(device_type: str, world_size: int) -> None:
    drop_nccl_settings_on_gloo(device_type)
    quiet_dtensor_rng_on_one_cpu_rank(device_type, world_size)
    quiet_torchdata_set_vital()
    quiet_router_autocast_on_cpu(device_type)


@contextmanager
def titan_log_level_at_least(level: int) -> Iterator[None]:
    """torchtitan's logger shows nothing below ``level`` inside the block (its own lines that ours replace)."""
    from torchtitan.tools.logging import logger

    previous = logger.level
    logger.setLevel(max(previous, level))
    try:
        yield
    finally:
        logger.setLevel(previous)
