"""torchtitan's native Qwen3 / Qwen3-MoE model config, shaped by a Hugging Face architecture.

Shared by the backends that train torchtitan's own Qwen3 (native, nki-moe) and by the
checkpoint tools that compare against it. We build ``Qwen3Model.Config`` from :class:`Qwen3Architecture` (i.e. from the
checkpoint's ``config.json``) rather than from torchtitan's flavor table, with per-document
attention on every layer (``models.attention``): torchtitan's block-causal Flex on CUDA, block-sparse
attention elsewhere (Flex has no CPU backward, and Neuron runs neither Flex nor varlen).

Also here, because the hf-v5 backend's model shares them: the random initialisation every backend's
Qwen3 starts from (:data:`INIT_STD`, :func:`residual_init_std`), and the state-dict adapter's
``hf_assets_path`` rule (:func:`with_shard_index`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
from huggingface_hub.constants import SAFETENSORS_INDEX_FILE
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import (
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.common.param_init import skip_param_init
from torchtitan.models.common.rope import RoPE
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.models.attention import (
    DocumentAttention,
    DocumentBlockAttention,
    default_document_attention,
    inner_attention_config,
    uses_document_blocks,
)
from qwen3_titan_common.models.context_parallel import parallelize_decoder
from qwen3_titan_common.models.experts import ActivationDtypeGroupedExperts
from qwen3_titan_common.models.fsdp_comms import parallelized_for_the_job
from qwen3_titan_common.models.routing import record_routing, recording_router_config
from qwen3_titan_common.perf.expert_load import ExpertCounts
from qwen3_titan_common.perf.flops import FlopsConvention
from qwen3_titan_common.perf.precision import compute_autocast

# Random initialisation shared by every backend's Qwen3 (hf-v5's too), so their models start alike.
INIT_STD = 0.02


def residual_init_std(num_layers: int) -> float:
    """Std of the projections that write into the residual stream (scaled down with depth)."""
    return INIT_STD / (2 * num_layers) ** 0.5


def _normal(std: float) -> Callable:
    return partial(nn.init.normal_, std=std)


def _linear_init(std: float = INIT_STD) -> dict[str, Callable]:
    return {"weight": _normal(std), "bias": nn.init.zeros_}


def _residual_std(arch: Qwen3Architecture) -> float:
    return residual_init_std(arch.num_hidden_layers)


def _norm(arch: Qwen3Architecture, size: int) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=size, eps=arch.rms_norm_eps, param_init={"weight": nn.init.ones_})


def _attention(arch: Qwen3Architecture, kind: DocumentAttention, fixed_shapes: bool):
    return make_gqa_config(
        dim=arch.hidden_size,
        n_heads=arch.num_attention_heads,
        n_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        wqkv_param_init=_linear_init(),
        wo_param_init=_linear_init(_residual_std(arch)) if arch.is_moe else _linear_init(),
        inner_attention=inner_attention_config(kind, fixed_shapes=fixed_shapes),
        fuse_qkv=True,
        rope=_rope(arch),
        qk_norm=_norm(arch, arch.head_dim),
    )


class ScaledCosSinRoPE(CosSinRoPE):
    """torchtitan's cos/sin RoPE with its cos and sin multiplied by ``attention_factor``, as transformers applies
    YaRN (torchtitan's YaRN leaves that factor to the model's softmax scale, which its Qwen3 does not apply)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        attention_factor: float = 1.0

    def _precompute_cache(self) -> torch.Tensor:
        return CosSinRoPE._precompute_cache(self) * self.config.attention_factor


def share_rope_caches(model: nn.Module) -> None:
    """Every RoPE module of ``model`` holding the cache of the first of its kind and config, on its device.

    torchtitan gives every attention layer a RoPE module, each computing and keeping a cache buffer of its own
    (positions x 2 x head_dim, fp32): identical copies, 1.1 GiB a rank for Qwen3-8B's 36 layers at 32,768
    positions, 3.5 GiB for Qwen3-0.6B's 28 at 131,072. Called when the model is built (on the meta device, so
    the memory estimate counts one) and after ``init_states`` computes them (the others are then freed). The
    plain RoPE stays torchtitan's own ``CosSinRoPE.Config``, which ``--override.imports`` factories target
    exactly (the nki-moe backend's ``rope_hf`` kernel, a user's own). Per model: torchtitan annotates a
    model's buffers with its own device mesh."""
    first: dict[tuple[type, str, str], torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, RoPE):
            key = (type(module), repr(module.config), str(module.cache.device))
            module.cache = first.setdefault(key, module.cache)


def _rope(arch: Qwen3Architecture) -> CosSinRoPE.Config:
    """Plain RoPE, or YaRN as the checkpoint's config.json asks (``arch.yarn``)."""
    if arch.yarn is None:
        return CosSinRoPE.Config(
            dim=arch.head_dim, max_seq_len=arch.max_position_embeddings, theta=arch.rope_theta
        )
    yarn = arch.yarn
    return ScaledCosSinRoPE.Config(
        dim=arch.head_dim,
        max_seq_len=arch.max_position_embeddings,
        theta=arch.rope_theta,
        scaling="yarn",
        rope_factor=yarn.factor,
        beta_fast=yarn.beta_fast,
        beta_slow=yarn.beta_slow,
        original_seq_len=yarn.original_max_position_embeddings,
        truncate=yarn.truncate,
        attention_factor=yarn.attention_factor,
    )


def _moe(arch: Qwen3Architecture):
    moe = arch.moe
    experts_init = {
        "w1_EFD": _normal(INIT_STD),
        "w3_EFD": _normal(INIT_STD),
        "w2_EDF": _normal(_residual_std(arch)),
    }
    routed_experts = make_routed_experts_config(
        dim=arch.hidden_size,
        hidden_dim=moe.moe_intermediate_size,
        num_experts=moe.num_experts,
        top_k=moe.num_experts_per_tok,
        param_init=experts_init,
        comm_backend="standard",
    )
    stock = routed_experts.inner_experts
    routed_experts.inner_experts = ActivationDtypeGroupedExperts.Config(
        **{f.name: getattr(stock, f.name) for f in dataclasses.fields(stock)}
    )
    return make_moe_config(
        num_experts=moe.num_experts,
        router=recording_router_config(
            make_router_config(
                dim=arch.hidden_size,
                num_experts=moe.num_experts,
                gate_param_init=_linear_init(),
                top_k=moe.num_experts_per_tok,
                score_func="softmax",
                route_norm=moe.norm_topk_prob,
            )
        ),
        routed_experts=routed_experts,
        # No routing bias (torchtitan's auxiliary-loss-free balancing): Hugging Face's Qwen3-MoE has
        # nowhere to keep one, so a bias learned here would be dropped by the export, and the exported
        # model would route, and score, differently from the model that was trained and validated.
        load_balance_coeff=None,
    )


def _layer(
    arch: Qwen3Architecture, attention: DocumentAttention, fixed_shapes: bool
) -> Qwen3TransformerBlock.Config:
    if arch.is_moe:
        mlp = {"moe": _moe(arch)}
    else:
        mlp = {
            "feed_forward": make_ffn_config(
                dim=arch.hidden_size,
                hidden_dim=arch.intermediate_size,
                w1_param_init=_linear_init(),
                w2w3_param_init=_linear_init(),
            )
        }
    return Qwen3TransformerBlock.Config(
        attention_norm=_norm(arch, arch.hidden_size),
        ffn_norm=_norm(arch, arch.hidden_size),
        attention=_attention(arch, attention, fixed_shapes),
        **mlp,
    )


class Qwen3TitanModel(Qwen3Model):
    """torchtitan's Qwen3, counting its FLOPs per token by the project's convention (``perf.flops``),
    and attending per document however it is called.

    torchtitan asks the model config for FLOPs per token once (``get_nparams_and_flops``) and
    its metrics divide by it; counting them here, from the ``config.json`` architecture, gives
    every backend one convention with nothing overwritten afterwards.

    torchtitan's Trainer and Validator build attention masks from the batch's positions only for
    Flex and varlen; for :class:`DocumentBlockAttention` (its block pairs), and for callers that pass positions alone
    (``eval``, ``verify-checkpoint``), the forward builds them, so a document is scored the same way
    wherever the model runs.

    ``compute_dtype``: on a one-CPU-rank job, which trains it without FSDP (``models.fsdp_comms``), the dtype
    its forward autocasts to; None elsewhere.
    """

    compute_dtype: torch.dtype | None = None

    def __init__(self, config: Config):
        super().__init__(config)
        share_rope_caches(self)

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        super().init_states(buffer_device=buffer_device)
        share_rope_caches(self)  # each layer's module computed its own

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3Model.Config):
        flops: FlopsConvention | None = None
        """The architecture the FLOPs are counted from (and whether attention is halved for causality)."""

        def update_from_config(self, *, config, **kwargs) -> None:
            # Explicit parent: a slots dataclass is a new class, so zero-argument super() cannot find it.
            Qwen3Model.Config.update_from_config(self, config=config, **kwargs)
            if self.flops is not None:
                self.flops = self.flops.with_metrics_config(config.metrics)

        def with_routing_recorded(self) -> Qwen3TitanModel.Config:
            """A copy whose routers keep each training forward's routing (for the balance loss)."""
            config = copy.deepcopy(self)
            record_routing(config)
            return config

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            nparams, titan_flops = Qwen3Model.Config.get_nparams_and_flops(self, model, seq_len)
            if self.flops is None:
                return nparams, titan_flops
            return nparams, self.flops.per_token(seq_len)

    def take_expert_counts(self) -> ExpertCounts | None:
        """Per MoE layer, the tokens each expert took since the last call (torchtitan's own counter, which
        the auxiliary-loss-free bias would consume; it is off here), then zeroed; None for a dense model."""
        counts, top_k = {}, 0
        for layer_id, block in self.layers.items():
            if not getattr(block, "moe_enabled", False):
                continue
            counter = block.moe.tokens_per_expert_E
            local = counter.to_local() if hasattr(counter, "to_local") else counter
            counts[layer_id] = local.detach().clone()
            local.zero_()
            top_k = block.moe.router.top_k
        return ExpertCounts(top_k, counts) if counts else None

    def get_attention_masks(self, positions: torch.Tensor):
        attention = self.config.first_attention
        if attention is not None and isinstance(attention.inner_attention, DocumentBlockAttention.Config):
            return attention.inner_attention.document_blocks(positions)
        return Qwen3Model.get_attention_masks(self, positions)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks=None,
    ):
        if attention_masks is None and positions is not None and self.config.first_attention is not None:
            attention_masks = self.get_attention_masks(positions)
        with compute_autocast(self.compute_dtype):
            return Qwen3Model.forward(self, tokens, positions, attention_masks)


def titan_qwen3_model_config(
    arch: Qwen3Architecture, attention: DocumentAttention | None = None
) -> Qwen3TitanModel.Config:
    """``attention``: the per-document inner attention (default: the one for this machine's device; on
    Neuron with its block pairs in a handful of shapes)."""
    from qwen3_titan_common.runtime.device import detect_device

    device_kind = detect_device().kind
    if attention is None:
        attention = default_document_attention(device_kind)
    fixed_shapes = device_kind == "neuron"
    tied = arch.tie_word_embeddings
    return Qwen3TitanModel.Config(
        flops=FlopsConvention(arch),
        vocab_size=arch.vocab_size,
        dim=arch.hidden_size,
        norm=_norm(arch, arch.hidden_size),
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=arch.vocab_size,
            embedding_dim=arch.hidden_size,
            # With tying, the embedding is initialised through lm_head.
            param_init={"weight": skip_param_init} if tied else {"weight": _normal(INIT_STD)},
        ),
        lm_head=Linear.Config(
            in_features=arch.hidden_size,
            out_features=arch.vocab_size,
            param_init=_linear_init(),
        ),
        layers=[_layer(arch, attention, fixed_shapes) for _ in range(arch.num_hidden_layers)],
    )


def with_shard_index(hf_assets_path: str | None) -> str | None:
    """``hf_assets_path`` if it holds a safetensors shard index, else None.

    torchtitan's ``StateDictAdapter.__init__`` reads ``hf_assets_path/model.safetensors.index.json`` to lay
    out the HF checkpoints torchtitan itself would save (``--checkpoint.last_save_in_hf``), and warns when the
    file is absent. ``hf_assets_path`` is the tokenizer folder of every run that does not start from a sharded
    checkpoint, so the warning came with every default run while saying nothing about it: our exports plan
    their own shards (``hf.export.plan_shards``). The path itself is kept, for torchtitan's other reader of it.
    """
    if hf_assets_path and (Path(hf_assets_path) / SAFETENSORS_INDEX_FILE).is_file():
        return hf_assets_path
    return None


class Qwen3TitanStateDictAdapter(Qwen3StateDictAdapter):
    """torchtitan's Qwen3 state-dict adapter, told about ``hf_assets_path``'s shard index only when it has one."""

    def __init__(self, model_config, hf_assets_path: str | None):
        super().__init__(model_config, with_shard_index(hf_assets_path))
        # torchtitan loads HF weights from here when no initial_load_path is given.
        self.hf_assets_path = hf_assets_path


def parallelize_qwen3_documents(model: Qwen3Model, **kwargs) -> Qwen3Model:
    """torchtitan's ``parallelize_qwen3``; under context parallelism with our per-document attention, the same
    steps without torchtitan's CP wrapping of the attention (``models.context_parallel``)."""
    if kwargs["parallel_dims"].cp_enabled and uses_document_blocks(model.config):
        return parallelize_decoder(model, **kwargs)
    return parallelize_qwen3(model, **kwargs)


def titan_qwen3_model_spec(arch: Qwen3Architecture, flavor: str) -> ModelSpec:
    return ModelSpec(
        name="qwen3",
        flavor=flavor,
        model=titan_qwen3_model_config(arch),
        parallelize_fn=parallelized_for_the_job(parallelize_qwen3_documents),
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook if arch.is_moe else None,
        state_dict_adapter=Qwen3TitanStateDictAdapter,
    )
