"""Config functions of the native backend: ``--module qwen3_titan_native --config NAME``.

Every function takes no arguments and returns a ``Trainer.Config``; torchtitan's CLI flags
are applied on top (``--training.steps 5``).
"""

from __future__ import annotations

# Helpers are imported under private names: torchtitan lists every public callable
# of this module as a config function in its "not found" error.
from qwen3_titan_common.assets import default_architecture as _default_architecture
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec as _titan_qwen3_model_spec
from qwen3_titan_common.train.config_functions import BackendConfigs as _BackendConfigs
from torchtitan.trainer import Trainer

_CONFIGS = _BackendConfigs("native", _titan_qwen3_model_spec, module=__package__)


def debug() -> Trainer.Config:
    """The embedded tiny Qwen3 (about 4M parameters) on the embedded corpus."""
    return _CONFIGS.tiny(_default_architecture(), "debug")


qwen3_0_6b = _CONFIGS.published("qwen3_0_6b")
qwen3_1_7b = _CONFIGS.published("qwen3_1_7b")
qwen3_4b = _CONFIGS.published("qwen3_4b")
qwen3_8b = _CONFIGS.published("qwen3_8b")
native_qwen3_4b = _CONFIGS.recipe_4b_2507(
    "native_qwen3_4b", doc="The recipe's config: Qwen3-4B-Instruct-2507 (RoPE theta 5e6) from assets/hf/."
)
