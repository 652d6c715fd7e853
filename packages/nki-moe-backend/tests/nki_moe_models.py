"""Tiny torchtitan Qwen3-MoE models, stock and with the registry's overrides, on the same weights."""

from __future__ import annotations

import copy

import torch
from qwen3_titan_common.arch.architecture import architecture_from_config
from qwen3_titan_common.assets import DEBUG_MOE_CONFIG
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config
from qwen3_titan_nki_moe import constraints
from qwen3_titan_nki_moe.overrides import KERNEL_OVERRIDES
from torchtitan.config.override import OverrideConfig, apply_overrides

SMALL_MOE = {
    **DEBUG_MOE_CONFIG,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "head_dim": 32,
}


def model_configs(config: dict = SMALL_MOE, overrides=KERNEL_OVERRIDES):
    """(stock, overridden) model configs of one architecture."""
    stock = titan_qwen3_model_config(architecture_from_config(config, "test config"))
    overridden = copy.deepcopy(stock)
    replaced = apply_overrides(OverrideConfig(imports=list(overrides)), overridden)
    return stock, overridden, replaced


def build(model_config, seed: int = 0, state_dict=None):
    torch.manual_seed(seed)
    model = model_config.build()
    model.init_states()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


# The NKI shape rules' inputs at two sizes: Qwen3-30B-A3B's, and the embedded debug_moe's.
QWEN3_30B_A3B_SHAPE = dict(
    seq_len=4096, head_dim=128, hidden_size=2048, rope_cache_len=40960, lnc=2, num_experts=128,
    moe_intermediate_size=768,
)  # fmt: skip
DEBUG_MOE_SHAPE = dict(
    seq_len=256,
    head_dim=64,
    hidden_size=256,
    rope_cache_len=2048,
    lnc=2,
    num_experts=8,
    moe_intermediate_size=256,
)


def kernel_shape(base: dict, **changes) -> constraints.KernelShape:
    return constraints.KernelShape(**{**base, **changes})


def parse_debug_moe(*flags: str):
    """``--module qwen3_titan_nki_moe --config debug_moe`` plus ``flags``, parsed by torchtitan's ConfigManager."""
    from torchtitan.config.manager import ConfigManager

    return ConfigManager().parse_args(["--module", "qwen3_titan_nki_moe", "--config", "debug_moe", *flags])
