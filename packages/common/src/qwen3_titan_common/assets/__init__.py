"""The embedded default: a tiny Qwen3, a tokenizer and a corpus, shipped in the package.

Made by ``tools/make_embedded_assets.py``; provenance in ``default/PROVENANCE.md``.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

from qwen3_titan_common.arch.architecture import Qwen3Architecture, architecture_from_config

# The tiny Qwen3-MoE every backend's `debug_moe` trains: Qwen3-MoE's structure at a CPU-sized shape,
# written as the config.json it would have, with the embedded default's attention and vocabulary. Its
# shapes also satisfy every NKI kernel rule (seq_len 256, hidden 256, head_dim 64, moe_intermediate 256),
# so it doubles as the Trainium smoke test.
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
    # As the published Qwen3-MoE checkpoints.
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "torch_dtype": "float32",
}


def default_assets_dir() -> Path:
    return Path(str(files("qwen3_titan_common") / "assets" / "default"))


def default_tokenizer_dir() -> Path:
    return default_assets_dir() / "tokenizer"


def default_corpus_path() -> Path:
    return default_assets_dir() / "corpus" / "corpus.jsonl"


def default_pairs_path() -> Path:
    """The embedded preference pairs (``--dataloader.dataset default-pairs``), built from the corpus."""
    return default_assets_dir() / "pairs" / "pairs.jsonl"


def default_model_dir() -> Path:
    return default_assets_dir() / "model"


@cache
def default_architecture() -> Qwen3Architecture:
    """The embedded model's architecture, read as its config.json writes it.

    That file states every field of a dense architecture, so transformers has no default to fill in
    and its reading (``arch.read_architecture``, which test_embedded_assets compares with this) gives
    the same; skipping it spares the default run transformers' import, most of a second in the
    launcher and again in every rank before the first step.
    """
    config = json.loads((default_model_dir() / "config.json").read_text())
    stated = {f.name: config[f.name] for f in dataclasses.fields(Qwen3Architecture) if f.name in config}
    return Qwen3Architecture(**stated, source=config)


@cache
def debug_moe_architecture() -> Qwen3Architecture:
    """The tiny Qwen3-MoE of every backend's ``debug_moe`` config (8 experts, top-2, 2 layers)."""
    return architecture_from_config(DEBUG_MOE_CONFIG, where="the embedded debug_moe config")
