"""Architectures of published Qwen3 checkpoints, for runs that name no model directory.

Each entry holds the architecture fields of the checkpoint's published ``config.json``
so that a config function can build the right shape offline (random init, dry runs).
When a model directory is given, its own ``config.json`` is read instead.
"""

from __future__ import annotations

from typing import Any

from qwen3_titan_common.arch.architecture import Qwen3Architecture, architecture_from_config

_DENSE_COMMON: dict[str, Any] = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_act": "silu",
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}


def _dense(hidden: int, layers: int, heads: int, ffn: int, tied: bool, **extra: Any) -> dict[str, Any]:
    return {
        **_DENSE_COMMON,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "intermediate_size": ffn,
        "tie_word_embeddings": tied,
        **extra,
    }


PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": _dense(1024, 28, 16, 3072, tied=True),
    "Qwen3-1.7B": _dense(2048, 28, 16, 6144, tied=True),
    "Qwen3-4B": _dense(2560, 36, 32, 9728, tied=True),
    # The 2507 refresh changed the RoPE base and context length, not the shape.
    "Qwen3-4B-Instruct-2507": _dense(
        2560, 36, 32, 9728, tied=True, rope_theta=5000000.0, max_position_embeddings=262144
    ),
    "Qwen3-8B": _dense(4096, 36, 32, 12288, tied=False),
    "Qwen3-30B-A3B": {
        **_DENSE_COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
}


# The config functions every backend may offer for a published shape (random init), by --config name:
# (published model, one-line summary). Backends make them with train.config_functions.
PUBLISHED_CONFIG_FUNCTIONS: dict[str, tuple[str, str]] = {
    "qwen3_0_6b": (
        "Qwen3-0.6B",
        "Qwen3-0.6B shape, random init (give a model directory to start from its weights).",
    ),
    "qwen3_1_7b": ("Qwen3-1.7B", "Qwen3-1.7B shape, random init."),
    "qwen3_4b": ("Qwen3-4B", "Qwen3-4B shape (RoPE theta 1e6, as the original release), random init."),
    "qwen3_8b": ("Qwen3-8B", "Qwen3-8B shape (untied embeddings), random init."),
    "qwen3_30b_a3b": ("Qwen3-30B-A3B", "Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8), random init."),
    "qwen3_nki_moe_config": (
        "Qwen3-30B-A3B",
        "The recipe's config: Qwen3-30B-A3B with NKI kernels on Trainium, reference kernels elsewhere.",
    ),
}


def published_architecture(name: str) -> Qwen3Architecture:
    if name not in PUBLISHED_CONFIGS:
        raise KeyError(f"unknown published model {name!r}; known: {', '.join(PUBLISHED_CONFIGS)}")
    return architecture_from_config(PUBLISHED_CONFIGS[name], where=f"published config of {name}")
