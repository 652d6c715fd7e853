"""Models ``eval`` runs: a Hugging Face directory's weights, or the same architecture randomly initialised.

A backend says which model it trains by a model-spec function (its ``Backend.eval_model``,
``"module:function"``): given the architecture (from the directory's ``config.json``), the longest sequence
the model will see and whether its routers record their choices, it returns the torchtitan ``ModelSpec`` its
trainer would build. :func:`eval_model` builds every backend's the same way: the checkpoint's weights through
the spec's own state-dict adapter (``hf.titan_load``), or a seeded random initialisation; on the CPU, in eval
mode, ``forward(tokens (B, L))`` giving logits ``(B, L, vocab)``. :func:`native_qwen3` is torchtitan's
Qwen3 / Qwen3-MoE as the native backend trains it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torchtitan.protocols.model_spec import ModelSpec

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.hf.model_dir import HFModelDir
from qwen3_titan_common.hf.titan_load import cover_tokens, load_titan_model

# (architecture, *, seq_len, routing_recorded) -> the ModelSpec a backend's trainer builds.
EvalModelSpec = Callable[..., ModelSpec]


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


def eval_model(
    model_spec: EvalModelSpec,
    arch: Qwen3Architecture,
    weights: HFModelDir | None,
    *,
    dtype: torch.dtype,
    seq_len: int,
    seed: int = 0,
    routing_recorded: bool = False,
) -> nn.Module:
    """The model ``model_spec`` describes for ``arch``, holding ``weights`` (None: random from ``seed``)."""
    spec = model_spec(arch, seq_len=seq_len, routing_recorded=routing_recorded)
    if weights is None:
        return randomly_initialised(spec.model.build, seed=seed, dtype=dtype)
    return load_titan_model(spec.model, spec.state_dict_adapter, weights, dtype)


def eval_model_of(reference: str) -> Callable[..., nn.Module]:
    """:func:`eval_model` for the model-spec function ``"module:function"`` names (a ``Backend.eval_model``)."""
    module, function = reference.split(":")
    return functools.partial(eval_model, getattr(importlib.import_module(module), function))


def native_qwen3(arch: Qwen3Architecture, *, seq_len: int, routing_recorded: bool = False) -> ModelSpec:
    """torchtitan's Qwen3 (dense or MoE) shaped by ``arch``, as ``models.qwen3`` configures it for training
    (``routing_recorded``: as a run with the router balance loss does)."""
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec

    spec = titan_qwen3_model_spec(arch, "eval")
    model_config = spec.model.with_routing_recorded() if routing_recorded else spec.model
    return dataclasses.replace(spec, model=cover_tokens(model_config, seq_len))
