"""Config functions of the hf-v5 backend: ``--module qwen3_titan_hf_v5 --config NAME``, and the trainer.

Every function takes no arguments and returns an ``HFv5Trainer.Config`` built by common's
``build_trainer_config`` (data, optimizer, schedule, checkpoints and HF export identical to
the native backend's, with the same run shapes, so losses compare); torchtitan's CLI flags
are applied on top (``--training.steps 5``).

``HFv5Trainer`` is ``Qwen3Trainer`` plus this backend's own flags, the ``hf_v5`` section:

    --hf_v5.attention {blocks,sdpa,flex}   blocks (block-sparse per document; the default off CUDA) or
                                    sdpa (a dense document mask; the default on CUDA); flex on CUDA only
    --hf_v5.untie_embeddings        train separate embedding and lm_head from a tied model

Everything else (HF directories in and out, data, optimizer, checkpoints) is
``Qwen3Trainer``'s, so the flags are the native backend's plus these two. (torchtitan lists
the lower-case public callables here as config functions; the classes are not among them.)
"""

from __future__ import annotations

import dataclasses
from typing import Literal

# Helpers are imported under private names: torchtitan lists every public callable
# of this module as a config function in its "not found" error.
from qwen3_titan_common.assets import debug_moe_architecture as _debug_moe_architecture
from qwen3_titan_common.assets import default_architecture as _default_architecture
from qwen3_titan_common.train.config_functions import BackendConfigs as _BackendConfigs
from qwen3_titan_common.train.trainer import Qwen3Trainer as _Qwen3Trainer

from qwen3_titan_hf_v5.model import hf_v5_model_spec as _hf_v5_model_spec


@dataclasses.dataclass(kw_only=True, slots=True)
class HFv5Options:
    attention: Literal["blocks", "sdpa", "flex"] | None = None
    """Per-document attention: blocks (block-sparse; default off CUDA), sdpa (dense mask; default on CUDA),
    flex (CUDA only)."""

    untie_embeddings: bool = False
    """Train lm_head apart from the embedding even if config.json ties them (export keeps lm_head)."""


class HFv5Trainer(_Qwen3Trainer):
    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_Qwen3Trainer.Config):
        hf_v5: HFv5Options = dataclasses.field(default_factory=HFv5Options)

    @classmethod
    def trains_tied_embeddings(cls, config: Config) -> bool:
        # --hf_v5.untie_embeddings trains lm_head apart from a tied checkpoint's embedding (it starts as a copy).
        return super().trains_tied_embeddings(config) and not config.hf_v5.untie_embeddings

    @classmethod
    def check_parallelism(cls, config: Config) -> None:
        """The parallelisms this backend does not implement, refused before anything is written (the
        model's ``update_from_config`` refuses them too, for a config built by hand)."""
        from qwen3_titan_common.errors import UserInputError
        from torchtitan.tools import utils as titan_utils

        from qwen3_titan_hf_v5.attention import default_attention
        from qwen3_titan_hf_v5.parallelize import check_parallelism

        attention = config.hf_v5.attention or default_attention(titan_utils.device_type)
        try:
            model = config.model_spec.model
            check_parallelism(
                config.parallelism, attention, num_experts=model.num_experts, num_layers=model.num_layers
            )
        except ValueError as err:
            raise UserInputError(str(err)) from None

    @classmethod
    def cuda_graph_blocker(cls, config: Config) -> str | None:
        if config.hf_v5.attention == "flex":
            return "--hf_v5.attention flex: transformers builds the flex block mask on the host at every step"
        if config.hf_v5.attention == "blocks":
            return "--hf_v5.attention blocks: the block pairs of each batch are read on the host"
        return None


_CONFIGS = _BackendConfigs("hf-v5", _hf_v5_model_spec, HFv5Trainer, module=__package__)


def debug() -> HFv5Trainer.Config:
    """The embedded tiny Qwen3 (about 4M parameters) as a transformers model, on the embedded corpus."""
    return _CONFIGS.tiny(_default_architecture(), "debug")


def debug_moe() -> HFv5Trainer.Config:
    """The embedded tiny Qwen3-MoE (8 experts, top-2, 2 layers) as transformers' Qwen3MoeForCausalLM."""
    return _CONFIGS.tiny(_debug_moe_architecture(), "debug_moe")


qwen3_0_6b = _CONFIGS.published("qwen3_0_6b")
qwen3_1_7b = _CONFIGS.published("qwen3_1_7b")
qwen3_4b = _CONFIGS.published("qwen3_4b")
v5_qwen3_4b = _CONFIGS.recipe_4b_2507(
    "v5_qwen3_4b",
    doc="The recipe's config: Qwen3-4B-Instruct-2507 (RoPE theta 5e6) from assets/hf/, through transformers v5.",
)
