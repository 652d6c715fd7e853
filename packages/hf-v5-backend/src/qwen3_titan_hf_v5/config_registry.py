"""Config functions of the hf-v5 backend: ``--module qwen3_titan_hf_v5 --config NAME``.

Every function takes no arguments and returns an ``HFv5Trainer.Config`` built by common's
``build_trainer_config`` (data, optimizer, schedule, checkpoints and HF export identical to
the native backend's, with the same run shapes, so losses compare); torchtitan's CLI flags
are applied on top (``--training.steps 5``), plus ``--hf_v5.attention`` and
``--hf_v5.untie_embeddings``.
"""

from __future__ import annotations

# Helpers are imported under private names: torchtitan lists every public callable
# of this module as a config function in its "not found" error.
from qwen3_titan_common.assets import debug_moe_architecture as _debug_moe_architecture
from qwen3_titan_common.assets import default_architecture as _default_architecture
from qwen3_titan_common.train.config_functions import BackendConfigs as _BackendConfigs

from qwen3_titan_hf_v5.model_spec import hf_v5_model_spec as _hf_v5_model_spec
from qwen3_titan_hf_v5.trainer import HFv5Trainer

_CONFIGS = _BackendConfigs("hf-v5", _hf_v5_model_spec, HFv5Trainer)


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
