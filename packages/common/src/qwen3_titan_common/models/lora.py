"""LoRA on torchtitan's Qwen3 / Qwen3-MoE (native and nki-moe backends), laid out as peft lays it out.

A model config converter (torchtitan's ``ModelConfigConverter``), applied to the model config before
anything is built, as torchtitan's own ``components.lora.LoRAConverter`` is:

- each targeted projection gets an adapter ``scaling * lora_b(lora_a(dropout(x)))`` beside its frozen
  weight, with peft's initialisation (``lora_a`` kaiming-uniform, ``lora_b`` zero, so training starts
  from the base model) and peft's ``scaling = alpha / rank``;
- torchtitan's Qwen3 computes q, k and v with one fused weight (``FusedQKVLinear.wqkv``, rows
  interleaved per KV group). A LoRA on that stacked weight would give q, k and v one shared ``A``: a
  different model from peft's, where each of ``q_proj``/``k_proj``/``v_proj`` has its own ``A`` and ``B``
  and any of them may be left out. So the fused module keeps one :class:`LoRAAdapter` per targeted
  projection (children ``wq``/``wk``/``wv``) and adds each one's output to that projection's output
  after the fused matmul has been split into q, k, v: ``q = x Wq^T + s * B_q A_q x``, exactly peft's
  ``q_proj`` (the split yields q in ``q_proj``'s row order, so no re-interleaving is needed);
- every other parameter is frozen when the model is built (:class:`LoRAQwen3Model`), so the optimizer,
  which takes only parameters that require gradients, never sees the base weights;
- MoE layers: the routed experts and the router are not adapted and stay frozen, and the routing's
  load-balancing bias is switched off (its update is not a trained parameter: it would move the
  base model's routing, which no adapter file can carry).

State-dict names follow one rule for every adapted projection: the base weight ``P.weight``, the
adapter ``P.lora_a.weight`` and ``P.lora_b.weight`` (for the fused q/k/v, ``P`` is
``...qkv_linear.wq``, whose base weight torchtitan's own state-dict hook already names
``...qkv_linear.wq.weight``). peft's modules name the base weight ``P.base_layer.weight`` and the
adapters ``P.lora_A.default.weight``; :func:`adapter_key` and :func:`base_weight_name` read both.

Why not torchtitan's ``LoRAConverter`` itself: its ``LoRALinear`` has no dropout, it has no answer for
the fused q/k/v, and it freezes each module through its config, a freeze an ``@override`` (nki-moe's
kernels replace the RMSNorm and expert configs after conversion) silently undoes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

import spmd_types as spmd
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common import Linear
from torchtitan.models.common.attention import FusedQKVLinear
from torchtitan.models.common.decoder_sharding import dense_param_placement
from torchtitan.models.common.moe import MoE
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module
from torchtitan.protocols.sharding import ShardingConfig
from torchtitan.tools.logging import logger

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.models.qwen3 import Qwen3TitanModel

# The Hugging Face projection names users target, and torchtitan's Qwen3 name for each.
ATTENTION_TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
MLP_TARGETS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
HF_TARGETS = {**ATTENTION_TARGETS, **MLP_TARGETS}
_FUSED_QKV = ("wq", "wk", "wv")

_ADAPTER_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[aAbB])(?:\.default)?\.weight$")
_PEFT_BASE_LAYER = ".base_layer."


def adapter_key(key: str) -> tuple[str, str] | None:
    """``(module path, "A" or "B")`` for an adapter's state-dict key (ours or peft's), else None."""
    found = _ADAPTER_KEY.match(key)
    return (found["module"], found["which"].upper()) if found else None


def base_weight_name(key: str) -> str:
    """A state-dict key as the base model names it (peft's ``P.base_layer.weight`` -> ``P.weight``)."""
    return key.replace(_PEFT_BASE_LAYER, ".")


@dataclass(frozen=True)
class LoRAParams:
    """Shape of every adapter of a run."""

    rank: int
    alpha: float
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _kaiming_uniform(weight: torch.Tensor) -> None:
    # nn.Linear's own default, which peft uses for lora_A.
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _adapter_sharding(base: ShardingConfig | None) -> ShardingConfig | None:
    """The adapters' placement where the base weight has one: replicated except along data parallelism.

    FSDP2 over torchtitan's SPMD mesh needs every parameter placed, the adapters included. Replicated
    is right because LoRA runs refuse tensor parallelism (``train.lora``): a tensor-parallel base
    would need ``lora_b`` (colwise) or ``lora_a`` (rowwise) sharded as it is.
    """
    if base is None or "weight" not in base.state_shardings:
        return None
    return ShardingConfig(state_shardings={"weight": dense_param_placement(tp=spmd.R)})


def _adapter_pair(
    in_features: int, out_features: int, rank: int, base_sharding: ShardingConfig | None
) -> tuple[Linear, Linear]:
    sharding = _adapter_sharding(base_sharding)
    lora_a = Linear.Config(
        in_features=in_features,
        out_features=rank,
        param_init={"weight": _kaiming_uniform},
        sharding_config=sharding,
    ).build()
    lora_b = Linear.Config(
        in_features=rank,
        out_features=out_features,
        param_init={"weight": nn.init.zeros_},
        sharding_config=sharding,
    ).build()
    return lora_a, lora_b


class LoRAAdapter(Module):
    """One projection's low-rank update on its own: ``lora_b(lora_a(dropout(x))) * scaling``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        in_features: int
        out_features: int
        lora: LoRAParams
        base_sharding: ShardingConfig | None = None
        """The sharding of the weight this adapter updates."""

    def __init__(self, config: Config):
        super().__init__()
        self.lora_a, self.lora_b = _adapter_pair(
            config.in_features, config.out_features, config.lora.rank, config.base_sharding
        )
        self.scaling = config.lora.scaling
        self.dropout = config.lora.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # peft's order of operations, so both give the same floating-point result.
        return self.lora_b(self.lora_a(F.dropout(x, self.dropout, self.training))) * self.scaling


class LoRALinear(Linear):
    """A frozen ``Linear`` plus its adapter, its parameters named as torchtitan's ``LoRALinear`` names them."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        lora: LoRAParams

    def __init__(self, config: Config):
        super().__init__(config)
        self.lora_a, self.lora_b = _adapter_pair(
            config.in_features, config.out_features, config.lora.rank, config.sharding_config
        )
        self.scaling = config.lora.scaling
        self.dropout = config.lora.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_b(self.lora_a(F.dropout(x, self.dropout, self.training))) * self.scaling
        return super().forward(x) + update


class LoRAFusedQKVLinear(FusedQKVLinear):
    """torchtitan's fused q/k/v projection plus a separate adapter for each targeted projection."""

    @dataclass(kw_only=True, slots=True)
    class Config(FusedQKVLinear.Config):
        lora: LoRAParams
        targets: tuple[str, ...]
        """Which of ``wq``, ``wk``, ``wv`` get an adapter."""

    def __init__(self, config: Config):
        super().__init__(config)
        dim = config.wqkv.in_features
        out = {"wq": config.n_heads * config.head_dim, "wk": config.n_kv_heads * config.head_dim}
        out["wv"] = out["wk"]
        self.adapted = tuple(config.targets)
        for name in self.adapted:
            adapter = LoRAAdapter.Config(
                in_features=dim,
                out_features=out[name],
                lora=config.lora,
                base_sharding=config.wqkv.sharding_config,
            )
            self.add_module(name, adapter.build())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Each of q, k, v: (B, L, heads, head_dim), heads in the order of q_proj's / k_proj's rows.
        projections = list(super().forward(x))
        for i, name in enumerate(_FUSED_QKV):
            if name in self.adapted:
                projections[i] = projections[i] + getattr(self, name)(x).view(projections[i].shape)
        return projections[0], projections[1], projections[2]


def _is_adapter_parameter(name: str) -> bool:
    return ".lora_a." in name or ".lora_b." in name


class LoRAQwen3Model(Qwen3TitanModel):
    """``Qwen3TitanModel`` whose parameters, adapters apart, are frozen as soon as it is built.

    Freezing here, once the whole tree exists, holds whichever module an ``@override`` put in place.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3TitanModel.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.freeze_base()

    def freeze_base(self) -> None:
        for name, param in self.named_parameters():
            param.requires_grad_(_is_adapter_parameter(name))

    def parallelize(self, parallel_dims) -> None:
        super().parallelize(parallel_dims)
        # torchtitan 0.3.0's SPMD sharding re-registers each sharded weight as a new nn.Parameter, which
        # requires grad (protocols/module.py, _spmd_distribute_state): freeze again once it is done.
        self.freeze_base()


def _init_fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in fields(config) if f.init}


def _replace(parent, attr, new) -> None:
    if isinstance(parent, list):
        parent[attr] = new
    else:
        setattr(parent, attr, new)


class LoRAConverter(ModelConfigConverter):
    """Adds adapters to a native Qwen3 model config (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        rank: int = 8
        alpha: float = 16.0
        dropout: float = 0.0
        targets: list[str] = field(default_factory=lambda: list(HF_TARGETS))
        """Hugging Face projection names (``q_proj`` ... ``down_proj``)."""

    def __init__(self, config: Config, **kwargs):
        self.config = config
        self.lora = LoRAParams(rank=config.rank, alpha=config.alpha, dropout=config.dropout)

    def convert(self, model_config: Module.Config) -> Module.Config:
        with_own_adapters = getattr(model_config, "with_adapters", None)
        if with_own_adapters is not None:
            # A model that adds adapters to its own modules (hf-v5-backend: peft on the transformers model).
            return with_own_adapters(self.config)
        if not isinstance(model_config, Qwen3TitanModel.Config):
            raise UserInputError(
                f"--lora: no LoRA conversion for {type(model_config).__qualname__} (expected torchtitan's Qwen3)"
            )
        qkv = tuple(
            ATTENTION_TARGETS[t] for t in self.config.targets if ATTENTION_TARGETS.get(t) in _FUSED_QKV
        )
        linear = {HF_TARGETS[t] for t in self.config.targets} - set(_FUSED_QKV)
        adapted = 0
        for fqn, cfg, parent, attr in list(model_config.traverse(Module.Config, recurse=True)):
            owner, _, name = fqn.rpartition(".")
            if isinstance(cfg, FusedQKVLinear.Config) and qkv:
                _replace(
                    parent, attr, LoRAFusedQKVLinear.Config(**_init_fields(cfg), lora=self.lora, targets=qkv)
                )
                adapted += len(qkv)
            elif (
                type(cfg) is Linear.Config
                and name in linear
                and owner.rpartition(".")[2] in ("attention", "feed_forward")
            ):
                _replace(parent, attr, LoRALinear.Config(**_init_fields(cfg), lora=self.lora))
                adapted += 1
            elif isinstance(cfg, MoE.Config) and cfg.load_balance_coeff is not None:
                cfg.load_balance_coeff = None
        if adapted == 0:
            raise UserInputError(
                f"--lora.targets {','.join(self.config.targets)}: no such projection in this model"
            )
        logger.info(f"[lora] {adapted} projections adapted (rank {self.lora.rank}, alpha {self.lora.alpha})")
        return LoRAQwen3Model.Config(**_init_fields(model_config))


class _LoRAKeys:
    """State-dict adapter behaviour for a model with adapters: the Hugging Face checkpoint is the base's.

    Adapter tensors are not in a base checkpoint (they are neither read from one nor exported to one);
    peft's ``P.base_layer.weight`` is the base checkpoint's ``P.weight``. Mixed in before the backend's
    own adapter class (:func:`lora_state_dict_adapter`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.renamed: dict[str, str] = {}

    def to_hf(self, state_dict):
        base = {}
        for key, value in state_dict.items():
            if adapter_key(key) is not None:
                continue
            name = base_weight_name(key)
            if name != key:
                self.renamed[name] = key
            base[name] = value
        return super().to_hf(base)

    def from_hf(self, hf_state_dict):
        state = super().from_hf(hf_state_dict)
        return {self.renamed.get(key, key): value for key, value in state.items()}


_LORA_ADAPTER_CLASSES: dict[type, type] = {}


def lora_state_dict_adapter(adapter_cls: type | None) -> type | None:
    """The backend's state-dict adapter class, reading and writing base checkpoints of a LoRA model.

    A class made here (and cached) rather than a wrapper object: torchtitan builds the adapter from
    ``ModelSpec.state_dict_adapter(model_config, hf_assets_path)`` and uses it as its own class.
    """
    if adapter_cls is None:
        return None
    if adapter_cls not in _LORA_ADAPTER_CLASSES:
        _LORA_ADAPTER_CLASSES[adapter_cls] = type(f"LoRA{adapter_cls.__name__}", (_LoRAKeys, adapter_cls), {})
    return _LORA_ADAPTER_CLASSES[adapter_cls]
