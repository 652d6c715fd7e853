"""The tiny checkpoints are what they claim: real proportions, sharded when asked, loadable by transformers."""

import json

import torch
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint, tiny_qwen3_config
from transformers import AutoModelForCausalLM


def test_proportions_are_those_of_real_qwen3():
    config = tiny_qwen3_config()
    # As in Qwen3-4B/8B: heads x head_dim is not the hidden size, and kv heads are fewer than heads.
    assert config.num_attention_heads * config.head_dim != config.hidden_size
    assert config.num_key_value_heads < config.num_attention_heads


def test_sharded_checkpoint_loads_with_every_weight_and_the_tokenizer(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", moe=True, tied=False, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert (path / "tokenizer.json").is_file()
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and not all(torch.equal(p, torch.ones_like(p)) for p in norms)  # perturbed from 1.0
