"""Config functions of the NKI MoE backend: ``--module qwen3_titan_nki_moe --config NAME``.

torchtitan's native Qwen3-MoE, built by ``titan_qwen3_model_spec`` from a ``config.json``-like
architecture, with the kernel registry's overrides listed in ``override.imports``. Every
function takes no arguments and returns an ``NkiMoETrainer.Config``; torchtitan's CLI flags
(and ``--kernels``) apply on top.
"""

from __future__ import annotations

import dataclasses

# Helpers are imported under private names: torchtitan lists every public callable
# of this module as a config function in its "not found" error.
from qwen3_titan_common.arch.published import published_architecture as _published_architecture
from qwen3_titan_common.assets import debug_moe_architecture as _debug_moe_architecture
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec as _titan_qwen3_model_spec
from qwen3_titan_common.train.config import debug_shape as _debug_shape
from qwen3_titan_common.train.config import real_size_shape as _real_size_shape
from qwen3_titan_common.train.config_functions import BackendConfigs as _BackendConfigs

from qwen3_titan_nki_moe.overrides import KERNEL_OVERRIDES as _KERNEL_OVERRIDES
from qwen3_titan_nki_moe.trainer import NkiMoETrainer as _NkiMoETrainer

_CONFIGS = _BackendConfigs(
    "nki-moe", _titan_qwen3_model_spec, _NkiMoETrainer, tuple(_KERNEL_OVERRIDES), module=__package__
)


def debug_moe() -> _NkiMoETrainer.Config:
    """A tiny Qwen3-MoE (8 experts, top-2, 2 layers, about 5M parameters) on the embedded corpus."""
    # The dense debug run's shape, 20 steps: enough for the MoE's loss to fall.
    shape = dataclasses.replace(_debug_shape("nki-moe", "debug"), steps=20, checkpoint_interval=20)
    return _CONFIGS.tiny(_debug_moe_architecture(), "debug_moe", shape)


def qwen3_30b_a3b_4layers() -> _NkiMoETrainer.Config:
    """Qwen3-30B-A3B's shape (128 experts, top-8) cut to 4 layers, random init."""
    name = "qwen3_30b_a3b_4layers"
    arch = _published_architecture("Qwen3-30B-A3B").with_changes(num_hidden_layers=4)
    return _CONFIGS.config(arch, name, _real_size_shape("nki-moe", name))


qwen3_30b_a3b = _CONFIGS.published("qwen3_30b_a3b")
qwen3_nki_moe_config = _CONFIGS.published("qwen3_nki_moe_config")
