"""Qwen3 model architecture, read from a Hugging Face ``config.json``.

The architecture is the source of truth for every backend: model configs are built
from it, never from a flavor name alone (torchtitan's "4B" flavor hard-codes RoPE
theta 1e6 while Qwen3-4B-Instruct-2507 uses 5e6).

``config.json`` is read by transformers' own ``Qwen3Config`` / ``Qwen3MoeConfig``, as
``AutoConfig.from_pretrained`` reads it, so a field the file leaves out takes the value
transformers' model would use, and RoPE settings go through transformers' normalisation
(v4 ``rope_theta``, v5 ``rope_parameters``). What is checked here is what no backend of
ours implements, and the sizes a file must state.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qwen3_titan_common.errors import UserInputError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


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
class YarnScaling:
    """YaRN's RoPE scaling, as transformers reads ``rope_scaling`` / ``rope_parameters`` (``rope_type: yarn``):
    the inverse frequencies interpolated by ``factor`` below the wavelengths ``beta_fast``/``beta_slow`` bound,
    and cos/sin scaled by ``attention_factor``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


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
    yarn: YarnScaling | None = None
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
        """This architecture with some top-level fields changed, in ``source`` too: an export writes
        ``source`` as its config.json, which must describe the weights next to it."""
        data = {**self.__dict__, **changes}
        source = dict(self.source)
        for key, value in changes.items():
            if key in _SOURCE_FIELDS:
                source[key] = value
                if key == "num_hidden_layers" and isinstance(source.get("layer_types"), list):
                    source["layer_types"] = source["layer_types"][:value]  # one entry per layer
            elif key == "moe" and value is not None:
                source.update(
                    num_experts=value.num_experts,
                    num_experts_per_tok=value.num_experts_per_tok,
                    moe_intermediate_size=value.moe_intermediate_size,
                    norm_topk_prob=value.norm_topk_prob,
                )
            elif key == "rope_theta":
                if isinstance(source.get("rope_parameters"), dict):
                    source["rope_parameters"] = {**source["rope_parameters"], "rope_theta": value}
                else:
                    source["rope_theta"] = value
            elif key != "source":
                raise ValueError(
                    f"with_changes({key}=...): not a config.json field this architecture can change"
                )
        data["source"] = source
        return Qwen3Architecture(**data)


# Fields of Qwen3Architecture that are config.json fields of the same name.
_SOURCE_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
)  # fmt: skip

# Sizes a config.json must state although transformers has defaults for them: those defaults are one
# particular checkpoint's shape (Qwen3Config's hidden 4096 x 32 layers x FFN 22016 is no published Qwen3;
# Qwen3MoeConfig's is Qwen3-30B-A3B with 24 of its 48 layers), so a file without one describes no model, and
# a random-init run would silently build a model of a size nobody asked for. Every other field, head_dim and
# num_key_value_heads included, takes transformers' default: that is the model transformers builds from it.
_REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# A Qwen3-MoE with every layer sparse (the only kind we build) never uses intermediate_size.
_REQUIRED_DENSE_SIZES = ("intermediate_size",)
_REQUIRED_MOE_SIZES = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
# transformers v5 writes "num_local_experts" (Qwen3MoeConfig maps num_experts onto it); published configs say
# "num_experts".
_FIELD_ALIASES = {"num_experts": ("num_experts", "num_local_experts")}
_POSITIVE_SIZES = (
    *_REQUIRED_SIZES,
    *_REQUIRED_DENSE_SIZES,
    *_REQUIRED_MOE_SIZES,
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)

# Fields whose non-default value changes the math in a way no backend implements.
_UNSUPPORTED_IF_SET: dict[str, Any] = {
    "attention_bias": False,
    "use_sliding_window": False,
}


def _check_model_type(config: Mapping[str, Any], where: str) -> str:
    model_type = config.get("model_type")
    if model_type not in (DENSE_MODEL_TYPE, MOE_MODEL_TYPE):
        raise ArchitectureError(
            f"{where}: model_type={model_type!r}, expected '{DENSE_MODEL_TYPE}' or '{MOE_MODEL_TYPE}'"
        )
    return model_type


def _check_required(config: Mapping[str, Any], model_type: str, where: str) -> None:
    sizes = _REQUIRED_SIZES + (_REQUIRED_MOE_SIZES if model_type == MOE_MODEL_TYPE else _REQUIRED_DENSE_SIZES)
    for key in sizes:
        if not any(name in config for name in _FIELD_ALIASES.get(key, (key,))):
            raise ArchitectureError(f"{where}: missing required field '{key}'")


def _check_rope_scaling(config: Mapping[str, Any], where: str) -> None:
    # Checked as the file wrote it, before transformers sees it: transformers folds rope_scaling into
    # rope_parameters (losing the field's name) and validates the scaling parameters first. Plain RoPE
    # written out ({"rope_type": "default"}, or the older "type") is what transformers reads as no scaling;
    # YaRN (Qwen3's 131,072 tokens) is read as transformers reads it (_yarn).
    scaling = config.get("rope_scaling")
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, Mapping) else None
    plain = (
        kind == "default"
        and {key: value for key, value in scaling.items() if key not in ("rope_type", "type", "rope_theta")}
        == {}
    )
    if not plain and kind != "yarn":
        raise ArchitectureError(
            f"{where}: field 'rope_scaling'={scaling!r} is not supported (expected None, "
            "{'rope_type': 'default'}: plain RoPE, or {'rope_type': 'yarn', ...}: YaRN)"
        )


def _check_model_class(config: Mapping[str, Any], model_type: str, where: str) -> None:
    """``architectures`` names the class transformers' AutoModelForCausalLM builds: another model's class
    under a Qwen3 ``model_type`` is a file that says two things."""
    expected = "Qwen3MoeForCausalLM" if model_type == MOE_MODEL_TYPE else "Qwen3ForCausalLM"
    classes = config.get("architectures")
    if classes is None:
        return
    if not isinstance(classes, list) or classes != [expected]:
        raise ArchitectureError(
            f"{where}: field 'architectures'={classes!r} does not match model_type {model_type!r} "
            f"(expected [{expected!r}]: this model is trained and exported as a {expected})"
        )


def _check_moe_head_dim(config: Mapping[str, Any], model_type: str, where: str) -> None:
    # Qwen3MoeConfig does not declare head_dim, so transformers neither type-checks it nor names it when it
    # trips over it (its RoPE validation compares it with an int).
    head_dim = config.get("head_dim")
    if model_type != MOE_MODEL_TYPE or head_dim is None:
        return
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise ArchitectureError(f"{where}: field 'head_dim' is {head_dim!r}, expected a positive integer")


def _one_line(err: BaseException) -> str:
    # KeyError's str() is the repr of its argument; the argument itself is the message.
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(str(text).split())


def _transformers_config(config: Mapping[str, Any], model_type: str, where: str) -> PreTrainedConfig:
    # Imported here, not at the top: transformers brings torch in (seconds), and the launcher imports this
    # module (through assets and hf) before it knows whether any config.json will be read.
    from huggingface_hub.errors import StrictDataclassError
    from transformers import Qwen3Config, Qwen3MoeConfig

    config_class = Qwen3MoeConfig if model_type == MOE_MODEL_TYPE else Qwen3Config
    try:
        # A deep copy: transformers fills defaults into the nested rope_parameters dict in place, and the
        # caller's dict is the `source` that exports write back unchanged.
        return config_class.from_dict(copy.deepcopy(dict(config)))
    except StrictDataclassError as err:
        # The cause names the field and the type transformers expected; the wrapper only adds a newline.
        raise ArchitectureError(
            f"{where}: {config_class.__name__} refuses it: {_one_line(err.__cause__ or err)}"
        ) from err
    except (ValueError, TypeError, KeyError) as err:
        raise ArchitectureError(f"{where}: {config_class.__name__} refuses it: {_one_line(err)}") from err


def _check_supported(hf: PreTrainedConfig, where: str) -> None:
    for key, supported in _UNSUPPORTED_IF_SET.items():
        if getattr(hf, key) != supported:
            raise ArchitectureError(
                f"{where}: field '{key}'={getattr(hf, key)!r} is not supported (expected {supported!r})"
            )
    rope_type = hf.rope_parameters.get("rope_type")
    if rope_type not in ("default", "yarn"):
        raise ArchitectureError(
            f"{where}: rope_parameters.rope_type={rope_type!r} is not supported (expected 'default': plain RoPE, "
            "or 'yarn')"
        )
    if hf.hidden_act != "silu":
        raise ArchitectureError(
            f"{where}: field 'hidden_act'={hf.hidden_act!r} is not supported (expected 'silu')"
        )
    if getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", None):
        raise ArchitectureError(
            f"{where}: decoder_sparse_step={hf.decoder_sparse_step}, "
            f"mlp_only_layers={list(hf.mlp_only_layers)}: only all-MoE layers are supported "
            "(expected decoder_sparse_step=1 and mlp_only_layers=[])"
        )


def _check_sizes(config: Mapping[str, Any], hf: PreTrainedConfig, where: str) -> None:
    # transformers checks the types of these, not their values.
    for key in _POSITIVE_SIZES:
        value = getattr(hf, key, None)
        if value is not None and value < 1:
            raise ArchitectureError(f"{where}: field '{key}' is {value}, expected a positive integer")
    experts, chosen = getattr(hf, "num_experts", None), getattr(hf, "num_experts_per_tok", None)
    if experts is not None and chosen is not None and chosen > experts:
        raise ArchitectureError(
            f"{where}: num_experts_per_tok={chosen} is more than num_experts={experts} (each token is routed to "
            "that many different experts)"
        )
    if hf.num_attention_heads % hf.num_key_value_heads:
        default = (
            "" if "num_key_value_heads" in config else " (transformers' default: the file does not set it)"
        )
        raise ArchitectureError(
            f"{where}: num_attention_heads={hf.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={hf.num_key_value_heads}{default}"
        )


def _rope_theta(config: Mapping[str, Any], hf: PreTrainedConfig, where: str) -> float:
    # transformers keeps the value as written: it checks rope_parameters' keys, not their types.
    theta = hf.rope_parameters["rope_theta"]
    if not isinstance(theta, int | float) or isinstance(theta, bool):
        params = config.get("rope_parameters")
        name = (
            "rope_parameters.rope_theta"
            if isinstance(params, Mapping) and "rope_theta" in params
            else "rope_theta"
        )
        raise ArchitectureError(f"{where}: field '{name}' is {theta!r}, expected a number")
    return float(theta)


def _head_dim(hf: PreTrainedConfig) -> int:
    # Without head_dim (Qwen3MoeConfig has none), transformers' attention uses hidden_size // num_attention_heads.
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _yarn(hf: PreTrainedConfig, where: str) -> YarnScaling | None:
    """YaRN's settings as transformers' ``_compute_yarn_parameters`` reads them (its attention factor too),
    None for plain RoPE."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = hf.rope_parameters
    if params.get("rope_type") != "yarn":
        return None
    try:
        _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](copy.deepcopy(hf))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise ArchitectureError(
            f"{where}: rope_scaling (yarn) refused by transformers: {_one_line(err)}"
        ) from err
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or hf.max_position_embeddings / original
    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _moe(hf: PreTrainedConfig) -> MoEArchitecture:
    return MoEArchitecture(
        num_experts=hf.num_experts,
        num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size,
        norm_topk_prob=hf.norm_topk_prob,
        decoder_sparse_step=hf.decoder_sparse_step,
        mlp_only_layers=tuple(hf.mlp_only_layers),
    )


def architecture_from_config(config: Mapping[str, Any], where: str = "config.json") -> Qwen3Architecture:
    model_type = _check_model_type(config, where)
    _check_required(config, model_type, where)
    _check_model_class(config, model_type, where)
    _check_rope_scaling(config, where)
    _check_moe_head_dim(config, model_type, where)
    hf = _transformers_config(config, model_type, where)
    _check_supported(hf, where)
    _check_sizes(config, hf, where)
    return Qwen3Architecture(
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        head_dim=_head_dim(hf),
        intermediate_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        rope_theta=_rope_theta(config, hf, where),
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=hf.tie_word_embeddings,
        moe=_moe(hf) if model_type == MOE_MODEL_TYPE else None,
        yarn=_yarn(hf, where),
        source=dict(config),
    )


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
