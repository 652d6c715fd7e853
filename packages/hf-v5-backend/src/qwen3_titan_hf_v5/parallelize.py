"""Tensor parallelism, activation checkpointing, torch.compile and FSDP2 for ``HFCausalLM``, in torchtitan's order.

The decoder stack ``model.model`` holds ``layers`` as torchtitan's own decoders do, so
torchtitan's AC policies (``ac_config.build().apply``) and per-block compile
(``apply_compile``) apply to it unchanged. FSDP2: one group per decoder layer, then the
root group, which holds what is left: the embedding, the final norm and ``lm_head``. With
tied embeddings those share one parameter, and FSDP2 requires a parameter to live in
exactly one group, so they must stay together in the root. Mixed precision is FSDP2's
``MixedPrecisionPolicy`` from ``--training.mixed_precision_param/_reduce``, as torchtitan
applies it (also on one rank).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from qwen3_titan_common.errors import UserInputError
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import (
    disable_fsdp_gradient_division,
    enable_fsdp_symm_mem,
    get_fsdp_reshard_after_forward_policy,
)
from torchtitan.tools.logging import logger

from qwen3_titan_hf_v5.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from qwen3_titan_hf_v5.pipeline import stage_plan
from qwen3_titan_hf_v5.tensor_parallel import apply_tensor_parallel, decoder_layers


def check_parallelism(
    parallelism: ParallelismConfig, attention: str = "blocks", *, num_experts: int = 0, num_layers: int = 1
) -> None:
    """FSDP/HSDP, tensor and pipeline parallelism of a dense model, and context parallelism over the
    block-sparse attention: refuse the rest in one line each, before anything is built."""
    for name, what in (
        ("tensor_parallel_degree", "split by tensor"),
        ("pipeline_parallel_degree", "stage by pipeline"),
    ):
        degree = getattr(parallelism, name)
        if degree != 1 and num_experts:
            raise UserInputError(
                f"--parallelism.{name} {degree}: this config.json is a Qwen3-MoE ({num_experts} routed experts), "
                f"which hf-v5-backend does not {what} parallelism; use 1, or the nki-moe backend"
            )
    if parallelism.pipeline_parallel_degree != 1:
        if parallelism.module_fqns_per_model_part is not None:
            raise UserInputError(
                "--parallelism.module_fqns_per_model_part: hf-v5-backend splits its stages by decoder layers "
                "(--parallelism.pipeline_parallel_layers_per_stage, _first_stage_less_layers, "
                "_last_stage_less_layers); leave it unset"
            )
        stage_plan(parallelism, num_layers)
    cp = parallelism.context_parallel_degree
    if cp != 1 and attention != "blocks":
        raise UserInputError(
            f"--parallelism.context_parallel_degree {cp}: context parallelism runs over the block-sparse "
            f"attention (--hf_v5.attention blocks), not --hf_v5.attention {attention}"
        )
    if parallelism.spmd_backend == "full_dtensor":
        raise UserInputError(
            "--parallelism.spmd_backend full_dtensor: the transformers model takes plain tensors; "
            "use spmd_types (the default) or partial_dtensor"
        )


def parallelize_hf_v5(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: ActivationCheckpointingConfig,
    dump_folder: str,
    skip_dp: bool = False,
) -> nn.Module:
    check_parallelism(parallelism, num_experts=model.config.num_experts, num_layers=model.config.num_layers)
    decoder = model.model
    if parallel_dims.ep_enabled:
        apply_expert_parallel(
            parallel_dims.get_mesh("ep"), model.config.token_dispatcher, decoder_layers(model)
        )
    if parallel_dims.tp_enabled:
        apply_tensor_parallel(
            model,
            parallel_dims.get_mesh("tp"),
            sequence_parallel=parallelism.enable_sequence_parallel,
            local_logits=parallelism.spmd_backend == "spmd_types",
        )
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(decoder)
    # After AC wrapping and before FSDP, as torchtitan does: one compiled graph per layer.
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(decoder, compile_config=compile_config, parallel_dims=parallel_dims)
    if not skip_dp:
        _apply_fsdp(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism)
    return model


def _fsdp_mesh(parallel_dims: ParallelDims, parallelism: ParallelismConfig) -> DeviceMesh:
    """The data-parallel mesh: (dp_replicate, shard) for HSDP, (shard,) for FSDP, kept at size 1.

    The transformers parameters are plain tensors, not SPMD-annotated ones, so FSDP2 gets the
    plain DP submesh (no ``dp_mesh_dims``) under either SPMD backend.
    """
    shard = "dp_shard" if parallelism.spmd_backend == "spmd_types" else "fsdp"
    names = ["dp_replicate", shard] if parallel_dims.dp_replicate_enabled else [shard]
    mesh = parallel_dims.get_optional_mesh(names, include_singleton_axes=True)
    assert mesh is not None, f"no {names} mesh"
    return mesh


def _apply_fsdp(
    model: nn.Module, *, parallel_dims: ParallelDims, training: TrainingConfig, parallelism: ParallelismConfig
) -> None:
    mesh = _fsdp_mesh(parallel_dims, parallelism)
    fsdp: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
            cast_forward_inputs=False,
        ),
    }
    if training.enable_cpu_offload:
        fsdp["offload_policy"] = CPUOffloadPolicy()
    reshard = get_fsdp_reshard_after_forward_policy(
        parallelism.fsdp_reshard_after_forward, pp_enabled=parallel_dims.pp_enabled
    )
    shards = mesh.size()
    experts_mesh = None
    if parallel_dims.ep_enabled:
        # Expert-parallel weights: FSDP over the data ranks that hold the same experts (torchtitan's ``efsdp``).
        names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
        experts_mesh = parallel_dims.get_optional_mesh(names, include_singleton_axes=True)
    for layer in decoder_layers(model):
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, ExpertParallelExperts):
            local = experts.gate_up_proj.to_local().shape[0]
            fully_shard(
                experts, **{**fsdp, "mesh": experts_mesh}, reshard_after_forward=reshard,
                shard_placement_fn=(lambda param: Shard(1)) if experts_mesh.size() > local else None,
            )  # fmt: skip
        fully_shard(
            layer, **fsdp, reshard_after_forward=reshard, shard_placement_fn=_experts_placement(layer, shards)
        )
    # The root group: embed_tokens, the final norm and lm_head (one tied parameter, or two).
    fully_shard(model, **fsdp)
    if parallelism.enable_fsdp_symm_mem:
        enable_fsdp_symm_mem(model)
    # torchtitan scales the loss by the global token count itself.
    disable_fsdp_gradient_division(model)
    logger.info(
        f"Applied FSDP2 to the transformers model: {len(decoder_layers(model))} decoder-layer groups + root "
        f"(embedding, norm, lm_head{', tied' if getattr(model, 'enable_weight_tying', False) else ''})"
    )


def _experts_placement(layer: nn.Module, shards: int):
    """Fused expert tensors (E, ., .) shard on dim 1 when there are more ranks than experts (no padding)."""
    experts = {p for name, p in layer.named_parameters() if ".mlp.experts." in f".{name}"}
    if not experts:
        return None
    num_experts = next(iter(experts)).shape[0]
    if shards <= num_experts:
        return None
    return lambda param: Shard(1) if param in experts else None
