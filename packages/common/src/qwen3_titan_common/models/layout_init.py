"""Random initial weights that do not depend on the parallel layout.

torchtitan initialises a model after sharding it: each rank draws its own shard from the global generator
(DTensor's random ops keep ranks in step on CUDA only, and a pipeline stage draws only its own layers), so one
seed gives other weights on 1 rank, under FSDP, TP, EP or PP, and losses of two layouts cannot be compared.
Here every parameter is drawn whole, on the CPU, by its own initialiser (the model config's ``param_init``, or
the model's ``init_parameter(name, tensor)`` where it has one, as hf-v5-backend's transformers model does)
from a generator seeded by the run's seed and the parameter's name, and each rank keeps its shard of it. The
same seed then gives the same weights in every layout, and only one whole tensor is in host memory at a time
(the largest of a 30B-A3B model: a layer's experts, 0.8 GB in fp32). Runs that start from a checkpoint or a
Hugging Face directory skip it: their weights are loaded over the random ones.
"""

from __future__ import annotations

import hashlib
from functools import partial

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.models.common.param_init import skip_param_init

from qwen3_titan_common.compat import param_initializers, without_checkpoint_wrapper


def parameter_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name``: stable across processes and Python versions."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@torch.no_grad()
def initialise_whole_then_shard(model_parts: list[torch.nn.Module], seed: int) -> int:
    """Re-draw every parameter that has an initialiser as described above; returns how many were drawn.
    The CPU generator's state is left as it was (the data order and dropout draw from it later)."""
    drawn: set[int] = set()
    saved = torch.get_rng_state()
    try:
        for part in model_parts:
            by_name = getattr(part, "init_parameter", None)
            for module_name, module in part.named_modules():
                initializers = param_initializers(module)
                for name, param in module.named_parameters(recurse=False):
                    fqn = without_checkpoint_wrapper(f"{module_name}.{name}" if module_name else name)
                    init = initializers.get(name)
                    if init is None and callable(by_name):
                        init = partial(by_name, fqn)
                    # A tied weight is listed under both modules and skipped by one (skip_param_init).
                    if init is None or init is skip_param_init or id(param) in drawn:
                        continue
                    _draw_whole(param, init, parameter_seed(seed, fqn))
                    drawn.add(id(param))
    finally:
        torch.set_rng_state(saved)
    return len(drawn)


def _draw_whole(param: torch.Tensor, init, seed: int) -> None:
    whole = torch.empty(param.shape, dtype=param.dtype, device="cpu")
    torch.default_generator.manual_seed(seed)
    init(whole)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank drew the same whole tensor, so each takes its shard locally
        # (torch.chunk's split, as FSDP2 and TP shard), with no communication.
        shard = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(whole)
