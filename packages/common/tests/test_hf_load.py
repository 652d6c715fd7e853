"""Tiny checkpoints written by transformers load into torchtitan's Qwen3 with equal logits."""

import pytest
import torch
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.hf.titan_load import build_titan_qwen3
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from transformers import AutoModelForCausalLM


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shard", [None, "60KB"], ids=["single", "sharded"])
def test_titan_logits_equal_transformers(tmp_path, moe, tied, dtype, shard):
    path = make_tiny_checkpoint(tmp_path / "ckpt", moe=moe, tied=tied, dtype=dtype, max_shard_size=shard)
    model_dir = open_model_dir(path)
    assert (len(model_dir.weight_files) > 1) == (shard is not None)
    assert model_dir.dtype_name == str(dtype).removeprefix("torch.")
    # Both sides compute in fp32 from the same stored weights, so they must agree to fp32 precision.
    titan = build_titan_qwen3(model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(
        0, model_dir.architecture.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        diff = (titan(tokens) - reference(tokens).logits).abs().max().item()
    assert diff <= ModelBounds.from_dir(path).logit_atol(seq_len=tokens.shape[1])


def test_moe_per_expert_keys_are_on_disk(tmp_path):
    model_dir = open_model_dir(make_tiny_checkpoint(tmp_path / "moe", moe=True))
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in model_dir.tensors
    assert model_dir.architecture.moe.num_experts == 4
