"""``eval --backend nki-moe-backend``: a Hugging Face directory in torchtitan's Qwen3-MoE with this backend's
kernels, chosen as the trainer chooses them (``--kernels auto``: NKI on Trainium where the shapes allow,
the reference kernels elsewhere) and swapped in by the same ``@override`` factories.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.hf.eval_models import randomly_initialised
from qwen3_titan_common.hf.model_dir import HFModelDir
from qwen3_titan_common.hf.titan_load import cover_tokens, load_titan_model
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
from torchtitan.config.override import apply_overrides

from qwen3_titan_nki_moe.config_registry import debug_moe
from qwen3_titan_nki_moe.trainer import prepare_kernels


def nki_moe_model(
    arch: Qwen3Architecture,
    weights: HFModelDir | None,
    *,
    dtype: torch.dtype,
    seq_len: int,
    seed: int = 0,
    routing_recorded: bool = False,
) -> nn.Module:
    # The backend's own config (fresh, ours to fill in), with this architecture and sequence length: what
    # its trainer would build. Not dataclasses.replace: that re-runs torchtitan's checks, which print.
    config = debug_moe()
    config.model_spec = titan_qwen3_model_spec(arch, "eval")
    if routing_recorded:
        config.model_spec.model = config.model_spec.model.with_routing_recorded()
    config.training.seq_len = seq_len
    cover_tokens(config.model_spec.model, seq_len)
    prepare_kernels(config)
    apply_overrides(config.override, config)
    spec = config.model_spec
    if weights is None:
        return randomly_initialised(spec.model.build, seed=seed, dtype=dtype)
    return load_titan_model(spec.model, spec.state_dict_adapter, weights, dtype)
