"""Loads an HF directory into torchtitan's native Qwen3 in one process (tools, tests).

Training runs load through torchtitan's sharded HF reader instead (see ``start.py``);
this is the single-process path the verify tool compares against transformers.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from qwen3_titan_common.hf.model_dir import HFModelDir


def read_hf_state_dict(model_dir: HFModelDir, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in model_dir.weight_files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                state[key] = tensor if dtype is None else tensor.to(dtype)
    return state


def build_titan_qwen3(model_dir: HFModelDir, dtype: torch.dtype = torch.float32, seq_len: int = 2048):
    """torchtitan's Qwen3 shaped by the directory's config.json, holding its weights."""
    import dataclasses

    from qwen3_titan_common.titan_qwen3 import titan_qwen3_model_spec

    spec = titan_qwen3_model_spec(model_dir.architecture, "verify")
    model_config = spec.model
    for layer in model_config.layers:
        # The RoPE cache only needs to cover the tokens we will run.
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    adapter = spec.state_dict_adapter(model_config, None)
    titan_state = adapter.from_hf(read_hf_state_dict(model_dir, dtype))
    missing, unexpected = model.load_state_dict(titan_state, strict=False)
    # RoPE caches are buffers computed from the config, not checkpoint tensors.
    missing = [
        k for k in missing if "rope" not in k and "expert_bias" not in k and "tokens_per_expert" not in k
    ]
    if missing or unexpected:
        raise RuntimeError(f"torchtitan model: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()
