"""Models ``eval`` runs: a Hugging Face directory's weights, or the same architecture randomly initialised.

A builder takes the architecture (from the directory's ``config.json``), the directory whose weights to
load (``None``: random initialisation from ``seed``), the dtype and the longest sequence it will see, and
returns a model on the CPU in eval mode whose ``forward(tokens (B, L))`` gives logits ``(B, L, vocab)``.
:func:`native_qwen3` is torchtitan's Qwen3 / Qwen3-MoE as the native backend trains it; a backend names its
own builder in its ``Backend.eval_model`` (``"module:function"``), built the way its trainer builds its model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.hf.model_dir import HFModelDir
from qwen3_titan_common.hf.titan_load import cover_tokens, load_titan_model


def randomly_initialised(build: Callable[[], nn.Module], *, seed: int, dtype: torch.dtype) -> nn.Module:
    """``build()`` on the meta device, then materialised and initialised by the model's own ``init_states``
    (the initialisation a training run starts from), seeded."""
    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=None)
    return model.to(dtype).eval()


def native_qwen3(
    arch: Qwen3Architecture,
    weights: HFModelDir | None,
    *,
    dtype: torch.dtype,
    seq_len: int,
    seed: int = 0,
    routing_recorded: bool = False,
) -> nn.Module:
    """torchtitan's Qwen3 (dense or MoE) shaped by ``arch``, as ``models.qwen3`` configures it for training
    (``routing_recorded``: as a run with the router balance loss does)."""
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec

    spec = titan_qwen3_model_spec(arch, "eval")
    model_config = spec.model.with_routing_recorded() if routing_recorded else spec.model
    model_config = cover_tokens(model_config, seq_len)
    if weights is None:
        return randomly_initialised(model_config.build, seed=seed, dtype=dtype)
    return load_titan_model(model_config, spec.state_dict_adapter, weights, dtype)
