"""Qwen3 model architecture, read from a Hugging Face ``config.json``.

The architecture is the source of truth for every backend: model configs are built
from it, never from a flavor name alone (torchtitan's "4B" flavor hard-codes RoPE
theta 1e6 while Qwen3-4B-Instruct-2507 uses 5e6).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qwen3_titan_common.errors import UserInputError


class ArchitectureError(UserInputError):
    """A config.json we cannot honour; the message names the file and field."""


DENSE_MODEL_TYPE = "qwen3"
MOE_MODEL_TYPE = "qwen3_moe"


@dataclass(frozen=True)
class MoEArchitecture:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Qwen3Architecture:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    moe: MoEArchitecture | None = None
    # The config.json this came from, kept so exports can start from it.
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("source")
        return data

    def with_changes(self, **changes: Any) -> Qwen3Architecture:
        data = {**self.__dict__, **changes}
        return Qwen3Architecture(**data)


# Fields whose non-default value changes the math in a way no backend implements.
_UNSUPPORTED_IF_SET: dict[str, Any] = {
    "attention_bias": False,
    "use_sliding_window": False,
    "rope_scaling": None,
}


def _rope_theta(config: Mapping[str, Any], where: str) -> float:
    # transformers v5 writes rope settings under "rope_parameters"; v4 used "rope_theta".
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise ArchitectureError(
                f"{where}: rope_parameters.rope_type={rope_type!r} is not supported "
                "(expected 'default': plain RoPE)"
            )
        if "rope_theta" in params:
            return float(params["rope_theta"])
    if "rope_theta" in config:
        return float(config["rope_theta"])
    raise ArchitectureError(f"{where}: missing 'rope_theta' (or rope_parameters.rope_theta)")


def _require(config: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in config:
        raise ArchitectureError(f"{where}: missing required field '{key}'")
    value = config[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ArchitectureError(f"{where}: field '{key}' is {value!r}, expected {kind.__name__}")
    return value


def architecture_from_config(config: Mapping[str, Any], where: str = "config.json") -> Qwen3Architecture:
    model_type = config.get("model_type")
    if model_type not in (DENSE_MODEL_TYPE, MOE_MODEL_TYPE):
        raise ArchitectureError(
            f"{where}: model_type={model_type!r}, expected '{DENSE_MODEL_TYPE}' or '{MOE_MODEL_TYPE}'"
        )
    for key, supported in _UNSUPPORTED_IF_SET.items():
        if config.get(key, supported) not in (supported,):
            raise ArchitectureError(
                f"{where}: field '{key}'={config[key]!r} is not supported (expected {supported!r})"
            )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ArchitectureError(f"{where}: field 'hidden_act'={act!r} is not supported (expected 'silu')")

    hidden = _require(config, "hidden_size", int, where)
    heads = _require(config, "num_attention_heads", int, where)
    head_dim = config.get("head_dim") or hidden // heads
    moe = None
    if model_type == MOE_MODEL_TYPE:
        moe = MoEArchitecture(
            # transformers v5 writes "num_local_experts"; the published configs say "num_experts".
            num_experts=_require(
                config,
                "num_local_experts"
                if "num_experts" not in config and "num_local_experts" in config
                else "num_experts",
                int,
                where,
            ),
            num_experts_per_tok=_require(config, "num_experts_per_tok", int, where),
            moe_intermediate_size=_require(config, "moe_intermediate_size", int, where),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        )
        if moe.decoder_sparse_step != 1 or moe.mlp_only_layers:
            raise ArchitectureError(
                f"{where}: decoder_sparse_step={moe.decoder_sparse_step}, "
                f"mlp_only_layers={list(moe.mlp_only_layers)}: only all-MoE layers are supported "
                "(expected decoder_sparse_step=1 and mlp_only_layers=[])"
            )
    arch = Qwen3Architecture(
        hidden_size=hidden,
        num_hidden_layers=_require(config, "num_hidden_layers", int, where),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(head_dim),
        intermediate_size=_require(config, "intermediate_size", int, where),
        vocab_size=_require(config, "vocab_size", int, where),
        rope_theta=_rope_theta(config, where),
        max_position_embeddings=_require(config, "max_position_embeddings", int, where),
        rms_norm_eps=_require(config, "rms_norm_eps", float, where),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        moe=moe,
        source=dict(config),
    )
    if arch.num_attention_heads % arch.num_key_value_heads:
        raise ArchitectureError(
            f"{where}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={arch.num_key_value_heads}"
        )
    return arch


def read_architecture(model_dir: str | Path) -> Qwen3Architecture:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ArchitectureError(f"{path}: not found (a Hugging Face model directory needs config.json)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArchitectureError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ArchitectureError(f"{path}: expected a JSON object")
    return architecture_from_config(config, str(path))
