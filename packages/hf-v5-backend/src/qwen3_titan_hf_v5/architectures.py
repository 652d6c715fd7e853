"""The tiny Qwen3-MoE of the ``debug_moe`` config: the embedded default's attention and
vocabulary (4096, the embedded tokenizer's) with 8 routed experts per layer."""

from __future__ import annotations

from typing import Any

from qwen3_titan_common.arch.architecture import Qwen3Architecture, architecture_from_config

DEBUG_MOE_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_act": "silu",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "vocab_size": 4096,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-06,
    # As the published Qwen3-MoE checkpoints.
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


def debug_moe_architecture() -> Qwen3Architecture:
    return architecture_from_config(DEBUG_MOE_CONFIG, where="hf-v5-backend debug_moe config")
