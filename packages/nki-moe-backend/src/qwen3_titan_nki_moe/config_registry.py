"""Config functions of the NKI MoE backend: ``--module qwen3_titan_nki_moe --config NAME``.

torchtitan's native Qwen3-MoE, built by ``titan_qwen3_model_spec`` from a ``config.json``-like
architecture, with the kernel registry's overrides listed in ``override.imports``. Every
function takes no arguments and returns an ``NkiMoETrainer.Config``; torchtitan's CLI flags
(and ``--kernels``) apply on top.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Helpers are imported under private names: torchtitan lists every public callable
# of this module as a config function in its "not found" error.
from qwen3_titan_common.arch.architecture import Qwen3Architecture as _Qwen3Architecture
from qwen3_titan_common.arch.architecture import architecture_from_config as _architecture_from_config
from qwen3_titan_common.arch.published import published_architecture as _published_architecture
from qwen3_titan_common.assets import default_tokenizer_dir as _default_tokenizer_dir
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec as _titan_qwen3_model_spec
from qwen3_titan_common.train.config import RunShape as _RunShape
from qwen3_titan_common.train.config import build_trainer_config as _build_trainer_config
from qwen3_titan_common.train.config import debug_shape as _debug_shape
from qwen3_titan_common.train.config import real_size_shape as _real_size_shape
from qwen3_titan_common.train.trainer import HFCheckpointConfig as _HFCheckpointConfig

from qwen3_titan_nki_moe.overrides import KERNEL_OVERRIDES as _KERNEL_OVERRIDES
from qwen3_titan_nki_moe.trainer import NkiMoETrainer as _NkiMoETrainer

BACKEND = "nki-moe"

# The tiny MoE every test and laptop run uses: Qwen3-MoE's structure at a CPU-sized shape,
# written as the config.json it would have. Its shapes also satisfy every NKI kernel rule
# (seq_len 256, hidden 256, head_dim 64, moe_intermediate 256), so it doubles as the
# Trainium smoke test. Vocabulary 4096 matches the embedded tokenizer.
DEBUG_MOE_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
    "moe_intermediate_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 4096,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "torch_dtype": "float32",
}


def _config(
    arch: _Qwen3Architecture, flavor: str, shape: _RunShape, hf: _HFCheckpointConfig | None = None
) -> _NkiMoETrainer.Config:
    base = _build_trainer_config(
        arch, flavor, _titan_qwen3_model_spec, assets_path=_default_tokenizer_dir(), shape=shape, hf=hf
    )
    config = _NkiMoETrainer.Config(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    )
    config.override.imports = list(_KERNEL_OVERRIDES)
    return config


def debug_moe() -> _NkiMoETrainer.Config:
    """A tiny Qwen3-MoE (8 experts, top-2, 2 layers, about 5M parameters) on the embedded corpus."""
    # The dense debug run's shape, 20 steps: enough for the MoE's loss to fall.
    shape = dataclasses.replace(_debug_shape(BACKEND, "debug"), steps=20, checkpoint_interval=20)
    arch = _architecture_from_config(DEBUG_MOE_CONFIG, where="debug_moe config")
    return _config(arch, "debug_moe", shape)


def qwen3_30b_a3b_4layers() -> _NkiMoETrainer.Config:
    """Qwen3-30B-A3B's shape (128 experts, top-8) cut to 4 layers, random init."""
    arch = _published_architecture("Qwen3-30B-A3B").with_changes(num_hidden_layers=4)
    return _config(arch, "qwen3_30b_a3b_4layers", _real_size_shape(BACKEND, "qwen3_30b_a3b_4layers"))


def qwen3_30b_a3b() -> _NkiMoETrainer.Config:
    """Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8), random init."""
    return _config(
        _published_architecture("Qwen3-30B-A3B"), "qwen3_30b_a3b", _real_size_shape(BACKEND, "qwen3_30b_a3b")
    )


def qwen3_nki_moe_config() -> _NkiMoETrainer.Config:
    """The recipe's config: Qwen3-30B-A3B with NKI kernels on Trainium, reference kernels elsewhere."""
    name = "qwen3_nki_moe_config"
    return _config(_published_architecture("Qwen3-30B-A3B"), name, _real_size_shape(BACKEND, name))
