"""Tiny Qwen3 / Qwen3-MoE Hugging Face directories written by transformers' ``save_pretrained``.

No model hub here: tests build checkpoints themselves and run the real loading code
on them.
"""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_qwen3_config(*, moe: bool = False, tied: bool = True, vocab_size: int = 4096, layers: int = 2):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # 4 heads x 32 = 128, not the hidden size 64: as in Qwen3-4B and 8B
        max_position_embeddings=1024,
        rope_theta=500000.0,
        tie_word_embeddings=tied,
        eos_token_id=0,
        pad_token_id=0,
    )
    if moe:
        return Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True,
        )  # fmt: skip
    return Qwen3Config(**common, intermediate_size=128)


def make_tiny_checkpoint(
    path: Path,
    *,
    moe: bool = False,
    tied: bool = True,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
    with_tokenizer: bool = True,
    vocab_size: int = 4096,
    tokenizer_dir: Path | None = None,
    config_changes: dict | None = None,
) -> Path:
    """Save a randomly initialised tiny model (and a tokenizer: the embedded one unless ``tokenizer_dir``).
    ``config_changes``: fields of its config.json other than the tiny one's (``rope_scaling``...)."""
    from qwen3_titan_common.assets import default_tokenizer_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = tiny_qwen3_config(moe=moe, tied=tied, vocab_size=vocab_size)
    if config_changes:
        source = config.to_dict()
        if "num_hidden_layers" in config_changes:
            source.pop("layer_types", None)  # one per layer: transformers derives them again
        config = type(config).from_dict({**source, **config_changes})
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    # Norm weights start at 1.0; perturb them so a loader that skips them is caught.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        AutoTokenizer.from_pretrained(str(tokenizer_dir or default_tokenizer_dir())).save_pretrained(path)
    return Path(path)
