"""A transformers v5 causal LM as a torchtitan model.

``HFCausalLM`` holds the two children of ``AutoModelForCausalLM.from_config(config.json)``: the
decoder stack ``model`` (``Qwen3Model`` / ``Qwen3MoeModel``) and the output projection
``lm_head``. Its parameter names are therefore exactly the Hugging Face ones
(``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``) and the transformers
modelling code runs unchanged. Around it, what torchtitan's Trainer asks of a model: a
``Config`` built on the meta device, ``update_from_config``, FLOPs per token,
``init_weights`` after sharding, and ``forward(tokens) -> logits``.

With tied embeddings, transformers makes ``lm_head.weight`` and
``model.embed_tokens.weight`` one ``Parameter``; it stays one parameter through sharding
(see ``parallelize.py``), training and export.

``hf_v5_model_spec`` is the torchtitan ``ModelSpec`` of the model shaped by a ``config.json``: this
model, its parallelize function and its state-dict adapter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn as nn
from qwen3_titan_common.arch.architecture import Qwen3Architecture, architecture_from_config
from qwen3_titan_common.compat import lm_head_applied_by_loss, without_checkpoint_wrapper
from qwen3_titan_common.models.attention import DocumentBlockAttention
from qwen3_titan_common.models.context_parallel import ContextParallelBlocks
from qwen3_titan_common.models.document_blocks import document_blocks
from qwen3_titan_common.models.fsdp_comms import parallelized_for_the_job
from qwen3_titan_common.models.lora import LoRAConverter, base_weight_name
from qwen3_titan_common.models.qwen3 import INIT_STD, residual_init_std
from qwen3_titan_common.models.routing import RoutingRecord
from qwen3_titan_common.perf.expert_load import ExpertCounts
from qwen3_titan_common.perf.flops import FlopsConvention
from qwen3_titan_common.perf.precision import compute_autocast
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, BaseEPTokenDispatcher
from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools import utils as titan_utils

from qwen3_titan_hf_v5.attention import ATTENTION_IMPLEMENTATIONS, default_attention
from qwen3_titan_hf_v5.lora import init_adapter_parameter, inject_lora
from qwen3_titan_hf_v5.parallelize import check_parallelism, parallelize_hf_v5
from qwen3_titan_hf_v5.pipeline import pipeline_hf_v5
from qwen3_titan_hf_v5.state_dict_adapter import HFv5StateDictAdapter

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


class HFCausalLM(BaseModel):
    compute_dtype: torch.dtype | None = None
    """On a one-CPU-rank job, which trains it without FSDP (``models.fsdp_comms``), the dtype its forward
    autocasts to; None elsewhere."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        hf_config: dict[str, Any] = field(default_factory=dict)
        """The model's config.json, as transformers reads it."""

        attention: Literal["blocks", "sdpa", "flex"] = "blocks"
        """blocks (block-sparse per document) or sdpa (a dense document mask) on every device; flex on CUDA
        only (set from --hf_v5.attention, whose default is blocks off CUDA and sdpa on CUDA)."""

        untie_embeddings: bool = False
        """Train separate embedding and lm_head even if config.json ties them (--hf_v5.untie_embeddings)."""

        flops: FlopsConvention | None = None
        """The architecture FLOPs per token are counted from (read from hf_config when not given)."""

        lora: LoRAConverter.Config | None = None
        """peft LoRA adapters on the transformers model (set from --lora.* by common's LoRA converter)."""

        record_routing: bool = False
        """Keep each training forward's router logits for the balance loss (set by --moe.router_aux_loss)."""

        token_dispatcher: BaseEPTokenDispatcher.Config | None = None
        """A Qwen3-MoE's token exchange under expert parallelism (``expert_parallel.py``): torchtitan's
        all-to-all, replaced by ours off CUDA (common's ``model_with_expert_exchange``); None for a dense model."""

        def with_routing_recorded(self) -> HFCausalLM.Config:
            """This config with the routing of each training forward kept (``models.routing``)."""
            return dataclasses.replace(self, record_routing=True)

        def with_adapters(self, lora: LoRAConverter.Config) -> HFCausalLM.Config:
            """This config with LoRA: peft's own layers (``lora.py``), not torchtitan's config conversion."""
            return dataclasses.replace(self, lora=lora)

        def document_attention(self):
            """The block-sparse per-document attention's settings (``models.context_parallel``), or None where
            this model attends otherwise (``--hf_v5.attention sdpa|flex``)."""
            if self.attention != "blocks":
                return None
            return DocumentBlockAttention.Config(fixed_shapes=titan_utils.device_type == "neuron")

        @property
        def tie_word_embeddings(self) -> bool:
            """Whether the model this config builds shares one embedding / output matrix."""
            return bool(self.hf_config.get("tie_word_embeddings", False)) and not self.untie_embeddings

        @property
        def num_layers(self) -> int:
            """Decoder layers (config.json's num_hidden_layers)."""
            return int(self.hf_config.get("num_hidden_layers", 1))

        @property
        def num_experts(self) -> int:
            """Routed experts per layer (0 for a dense model)."""
            cfg = self.hf_config
            return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)

        def transformers_config(self):
            """The ``PretrainedConfig`` transformers builds the model from."""
            from transformers import AutoConfig

            source = dict(self.hf_config)
            model_type = source.pop("model_type", None)
            if model_type not in SUPPORTED_MODEL_TYPES:
                raise ValueError(
                    f"config.json: model_type={model_type!r}, expected one of {SUPPORTED_MODEL_TYPES} "
                    "(hf-v5-backend trains Qwen3 and Qwen3-MoE)"
                )
            source["tie_word_embeddings"] = self.tie_word_embeddings
            source["use_cache"] = False
            return AutoConfig.for_model(model_type, **source)

        def update_from_config(self, *, config, **kwargs) -> None:
            options = getattr(config, "hf_v5", None)
            if options is not None:
                self.attention = options.attention or default_attention(titan_utils.device_type)
                self.untie_embeddings = options.untie_embeddings
            self.flops = self._flops().with_metrics_config(config.metrics)
            check_parallelism(
                config.parallelism, self.attention, num_experts=self.num_experts, num_layers=self.num_layers
            )
            # A dry run (fake process group) lays out a CUDA job on the CPU without running attention.
            dry_run = getattr(getattr(config, "comm", None), "mode", "default") == "fake_backend"
            if self.attention == "flex" and not dry_run:
                if titan_utils.device_type != "cuda":
                    raise ValueError(
                        f"--hf_v5.attention flex: FlexAttention trains on CUDA only, this run is on "
                        f"{titan_utils.device_type}; use --hf_v5.attention sdpa (the default)"
                    )

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            """Every parameter once (a tied weight counts once); FLOPs per token by the shared convention."""
            nparams = sum(param.numel() for param in model.parameters())
            return nparams, self._flops().per_token(seq_len)

        def _flops(self) -> FlopsConvention:
            if self.flops is None:
                self.flops = FlopsConvention(architecture_from_config(self.hf_config, where="config.json"))
            # --hf_v5.untie_embeddings trains a separate lm_head: counted as the untied model it is.
            arch = self.flops.architecture.with_changes(tie_word_embeddings=self.tie_word_embeddings)
            return dataclasses.replace(self.flops, architecture=arch)

    def __init__(self, config: Config):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.config = config
        hf_config = config.transformers_config()
        causal_lm = AutoModelForCausalLM.from_config(
            hf_config,
            attn_implementation=ATTENTION_IMPLEMENTATIONS[config.attention],
            dtype=torch.get_default_dtype(),
        )
        if config.lora is not None:
            inject_lora(causal_lm, config.lora)
        self.model = causal_lm.model
        self.lm_head = causal_lm.lm_head
        # transformers gives the embedding padding_idx=pad_token_id, which zeroes that row's
        # gradient. Padding in a row is EOS, and the Qwen3 configs here set
        # pad_token_id = eos_token_id: it would freeze the EOS embedding, which torchtitan's
        # native model trains. The forward is unchanged.
        self.model.embed_tokens.padding_idx = None
        self.hf_config = hf_config
        self._block_sparse = config.attention == "blocks"
        # Neuron compiles one graph per shape: the block pairs padded to a handful of them.
        self._fixed_shapes = titan_utils.device_type == "neuron"
        self.enable_weight_tying = config.tie_word_embeddings
        self._stage = False  # a pipeline stage's part of the model (as_pipeline_stage)
        self._residual_std = residual_init_std(hf_config.num_hidden_layers)
        self._is_moe = config.num_experts > 0
        self._record_routing = config.record_routing and self._is_moe
        self._recorded: list[RoutingRecord] = []
        if self._is_moe:
            # Tokens per expert per layer, for the step line; not state (neither checkpointed nor exported).
            self.register_buffer(
                "tokens_per_expert_LE",
                torch.zeros(hf_config.num_hidden_layers, config.num_experts, dtype=torch.float32),
                persistent=False,
            )
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        if tied != self.enable_weight_tying:
            raise RuntimeError(
                f"transformers built lm_head {'tied' if tied else 'untied'} to the embedding, expected "
                f"tie_word_embeddings={self.enable_weight_tying}"
            )

    @property
    def tok_embeddings(self) -> nn.Module | None:
        """torchtitan's name for the input embedding (used by its tools, e.g. the dry run); None on a pipeline
        stage other than the first."""
        return self.model.embed_tokens

    def as_pipeline_stage(self, layers: range, *, first: bool, last: bool) -> HFCausalLM:
        """This model cut down to one pipeline stage (``pipeline.py``), in place: the decoder layers of ``layers``
        under their own names (``model.layers.N``), the embedding on the first stage, the final norm and
        ``lm_head`` on the last. A stage runs the decoder layers itself (:meth:`_stage_forward`): transformers'
        stack runs every layer of its list, from the token ids to the norm."""
        decoder = self.model
        decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
        if not first:
            decoder.embed_tokens = None
        if not last:
            decoder.norm = None
            self.lm_head = None
        self._stage = True
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks: ContextParallelBlocks | None = None,
    ) -> torch.Tensor:
        """``attention_masks``: under context parallelism, this rank's block pairs against the whole row
        (``models.context_parallel``), which the trainer builds from the whole row's positions; otherwise the
        pairs are built here from ``positions``."""
        # One CPU rank computes in the compute dtype by autocast over fp32 weights (models.fsdp_comms).
        with compute_autocast(self.compute_dtype):
            return self._forward(tokens, positions, attention_masks)

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None,
        attention_masks: ContextParallelBlocks | None,
    ) -> torch.Tensor:
        # tokens (B, L) -> logits (B, L, vocab). Positions restart at 0 where each packed document starts:
        # they set RoPE, and keep each document's attention to itself (attention.py): the block pairs built
        # here once for every layer, or transformers' mask functions, which need attention_mask None and no
        # cache.
        if self._stage:
            return self._stage_forward(tokens, positions, attention_masks)
        routed = self._is_moe and self.training
        blocks = self._document_blocks(positions, attention_masks)
        outputs = self.model(
            input_ids=tokens,
            position_ids=positions,
            use_cache=False,
            output_router_logits=routed or None,
            **blocks,
        )
        if routed:
            self._keep_routing(outputs.router_logits)
        hidden_BLD = outputs.last_hidden_state
        if lm_head_applied_by_loss(self):
            return hidden_BLD
        return self.lm_head(hidden_BLD)

    def _document_blocks(
        self, positions: torch.Tensor | None, attention_masks: ContextParallelBlocks | None
    ) -> dict[str, Any]:
        """The decoder layers' ``document_blocks`` keyword: the CP rank's pairs handed in, or the block-sparse
        attention's pairs built here once from the positions; handed to every layer, None included (one
        document per row: causal SDPA), so that none derives them. Nothing for the other attentions."""
        if attention_masks is not None:
            return {"document_blocks": attention_masks}
        if not self._block_sparse:
            return {}
        pairs = document_blocks(positions, fixed_shapes=self._fixed_shapes) if positions is not None else None
        return {"document_blocks": pairs}

    def _stage_forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor | None,
        attention_masks: ContextParallelBlocks | None,
    ) -> torch.Tensor:
        """A pipeline stage's part of the forward: token ids (first stage) or the previous stage's hidden states
        in, through this stage's decoder layers (each called as transformers' stack calls it, with RoPE's tables
        and the attention mask of its layer's type built from the positions here, as that stack builds them),
        hidden states out, or logits on the last stage. Qwen3-MoE directories are not staged
        (``parallelize.check_parallelism``)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        decoder = self.model
        hidden_BLD = decoder.embed_tokens(inputs) if decoder.embed_tokens is not None else inputs
        blocks = self._document_blocks(positions, attention_masks)
        if positions is None:
            positions = torch.arange(hidden_BLD.shape[1], device=hidden_BLD.device)[None]
        config = decoder.config
        mask_inputs = {
            "config": config, "inputs_embeds": hidden_BLD, "attention_mask": None, "cache": None,
            "position_ids": positions,
        }  # fmt: skip
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        masks = {"full_attention": create_causal_mask(**mask_inputs)}
        if "sliding_attention" in layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_inputs)
        rope = decoder.rotary_emb(hidden_BLD, positions)
        for index, layer in decoder.layers.items():
            hidden_BLD = layer(
                hidden_BLD, attention_mask=masks[layer_types[int(index)]], position_ids=positions,
                position_embeddings=rope, use_cache=False, **blocks,
            )  # fmt: skip
        if decoder.norm is None:
            return hidden_BLD
        hidden_BLD = decoder.norm(hidden_BLD)
        if lm_head_applied_by_loss(self):
            return hidden_BLD
        return self.lm_head(hidden_BLD)

    def _keep_routing(self, router_logits: tuple[torch.Tensor, ...]) -> None:
        top_k = self.hf_config.num_experts_per_tok
        records = []
        for layer, logits_TE in enumerate(router_logits):
            # As transformers' load_balancing_loss_func reads them: softmax in the logits' dtype, then top-k
            # (the same experts as top-k of the logits, which is all the counts need).
            scores_TE = torch.softmax(logits_TE, dim=-1) if self._record_routing else logits_TE
            chosen_TK = torch.topk(scores_TE, top_k, dim=-1).indices
            with torch.no_grad():
                ones = torch.ones(chosen_TK.numel(), dtype=torch.float32, device=chosen_TK.device)
                self.tokens_per_expert_LE[layer].scatter_add_(0, chosen_TK.reshape(-1), ones)
            records.append(RoutingRecord(scores_TE, chosen_TK))
        if self._record_routing:
            self._recorded = records

    def take_routing(self) -> list[RoutingRecord]:
        """Every layer's routing of the last training forward (``models.routing``), handed out once."""
        records, self._recorded = self._recorded, []
        return records

    def take_expert_counts(self) -> ExpertCounts | None:
        """Per layer, the tokens each expert took since the last call, then zeroed; None for a dense model."""
        if not self._is_moe:
            return None
        counts = {str(layer): row.clone() for layer, row in enumerate(self.tokens_per_expert_LE)}
        self.tokens_per_expert_LE.zero_()
        return ExpertCounts(self.hf_config.num_experts_per_tok, counts)

    def verify_module_protocol(self) -> None:
        # The transformers submodules are plain nn.Modules by design: this backend trains them
        # unchanged. What the rest of the backend relies on is the layout, checked here.
        if self._stage:
            return  # a pipeline stage holds its own layers (as_pipeline_stage)
        layers = getattr(self.model, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) != self.hf_config.num_hidden_layers:
            raise RuntimeError(
                f"{type(self.model).__name__}: expected `layers` as an nn.ModuleList of "
                f"{self.hf_config.num_hidden_layers} decoder layers"
            )
        for name in ("embed_tokens", "norm", "rotary_emb"):
            if not isinstance(getattr(self.model, name, None), nn.Module):
                raise RuntimeError(f"{type(self.model).__name__}: no `{name}` submodule")

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """Random initialisation with the same distributions as the native backend's Qwen3."""
        if self.enable_weight_tying:
            # Tied again, as torchtitan's decoder does: ``to_empty`` gives each module of a model FSDP did not
            # shard (one CPU rank) its own copy of the parameter the two shared on the meta device.
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.no_grad():
            for name, param in self.named_parameters():  # a tied weight is initialised once
                self.init_parameter(name, param)
            self._init_self_buffers(buffer_device=buffer_device)

    def init_parameter(self, name: str, param: torch.Tensor) -> None:
        """Draw ``param`` (named ``name`` in this model) by its rule; also called on a whole, unsharded tensor
        (``models.layout_init``) so that every parallel layout starts from the same weights."""
        name = base_weight_name(without_checkpoint_wrapper(name))
        if init_adapter_parameter(name, param):
            return
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif name.endswith(".bias"):
            nn.init.zeros_(param)
        elif self._is_moe and name.endswith(("self_attn.o_proj.weight", "mlp.experts.down_proj")):
            # Output projections into the residual stream are scaled down with depth.
            nn.init.normal_(param, std=self._residual_std)
        elif name.endswith(_NORMAL_INIT_SUFFIXES):
            nn.init.normal_(param, std=INIT_STD)
        else:
            raise RuntimeError(f"{name}: no initialisation rule for this parameter (hf-v5-backend model.py)")

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        """torchtitan's hook for the buffers a model computes (also called on a model whose weights are
        loaded, ``hf.titan_load``): the experts' token counts, and RoPE's inverse frequencies, computed in the
        rotary module's constructor, which ran on the meta device: recomputed as transformers does (on the
        CPU, in fp32)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if self._is_moe:
            self.tokens_per_expert_LE = torch.zeros_like(self.tokens_per_expert_LE, device=buffer_device)

        for module in self.modules():
            buffers = dict(module.named_buffers(recurse=False))
            if "inv_freq" not in buffers or not hasattr(module, "rope_type"):
                continue
            if module.rope_type == "default":
                rope_init = module.compute_default_rope_parameters
            else:
                rope_init = ROPE_INIT_FUNCTIONS[module.rope_type]
            inv_freq, attention_scaling = rope_init(module.config)
            device = buffer_device or module.inv_freq.device
            module.inv_freq = inv_freq.to(device)
            if "original_inv_freq" in buffers:
                module.original_inv_freq = inv_freq.clone().to(device)
            module.attention_scaling = attention_scaling


_NORMAL_INIT_SUFFIXES = (
    "embed_tokens.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.gate.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    "lm_head.weight",
)


def hf_v5_model_spec(arch: Qwen3Architecture, flavor: str) -> ModelSpec:
    """``arch.source`` is the config.json transformers builds the model from."""
    dispatcher = None
    if arch.moe is not None:
        dispatcher = AllToAllTokenDispatcher.Config(
            num_experts=arch.moe.num_experts, top_k=arch.moe.num_experts_per_tok
        )
    return ModelSpec(
        name="hf_v5",
        flavor=flavor,
        model=HFCausalLM.Config(
            hf_config=dict(arch.source), flops=FlopsConvention(arch), token_dispatcher=dispatcher
        ),
        parallelize_fn=parallelized_for_the_job(parallelize_hf_v5),
        pipelining_fn=pipeline_hf_v5,
        post_optimizer_build_fn=None,
        state_dict_adapter=HFv5StateDictAdapter,
    )


def hf_v5_eval_spec(arch: Qwen3Architecture, *, seq_len: int, routing_recorded: bool = False) -> ModelSpec:
    """``eval --backend hf-v5-backend``: the model this backend trains, read through its own state-dict
    adapter (per-expert tensors fused as transformers v5 holds them). ``seq_len`` sizes nothing here:
    transformers computes RoPE per position."""
    spec = hf_v5_model_spec(arch, "eval")
    if routing_recorded:
        spec.model = spec.model.with_routing_recorded()
    return spec
