"""``eval --backend hf-v5-backend``: a Hugging Face directory as this backend trains it, an ``HFCausalLM``.

The model is the one the trainer builds (``hf_v5_model_spec``: transformers' modelling code with this
backend's per-document SDPA attention), its weights read through the backend's own state-dict adapter
(per-expert checkpoint tensors fused as transformers v5 holds them, ``lm_head`` of a tied model filled from
the embedding).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.eval_models import randomly_initialised
from qwen3_titan_common.hf.model_dir import HFModelDir
from qwen3_titan_common.hf.titan_load import read_hf_state_dict

from qwen3_titan_hf_v5.model import hf_v5_model_spec
from qwen3_titan_hf_v5.state_dict_adapter import HFv5StateDictAdapter


def hf_v5_model(
    arch: Qwen3Architecture,
    weights: HFModelDir | None,
    *,
    dtype: torch.dtype,
    seq_len: int,
    seed: int = 0,
    routing_recorded: bool = False,
) -> nn.Module:
    config = hf_v5_model_spec(arch, "eval").model
    if routing_recorded:
        config = config.with_routing_recorded()
    if weights is None:
        return randomly_initialised(config.build, seed=seed, dtype=dtype)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    # Only the RoPE frequencies are computed; every weight is replaced by the checkpoint's.
    model._init_rope_buffers(None)
    state = HFv5StateDictAdapter(config, None).from_hf(read_hf_state_dict(weights, dtype))
    missing, _ = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        # Assignment gave lm_head a parameter of its own; the tied model has one.
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise CheckpointError(f"{weights.path}: not loaded into the hf-v5 model: {sorted(missing)[:8]}")
    return model.eval()
