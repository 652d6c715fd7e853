"""Loads an HF directory into a torchtitan model in one process (eval, verify-checkpoint, tools, tests):
torchtitan's Qwen3 and Qwen3-MoE, or hf-v5's ``HFCausalLM``, each through its own state-dict adapter.

Training runs load through torchtitan's sharded HF reader instead (see ``start.py``);
this is the single-process path the verify tool compares against transformers.
Shards are streamed: host memory holds the model plus one shard (plus, for MoE, the
experts of a layer split across two shards until the layer is complete).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from qwen3_titan_common.compat import init_computed_buffers
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.model_dir import HFModelDir
from qwen3_titan_common.models.qwen3 import share_rope_caches

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# Model state that is computed, not stored in HF checkpoints.
_NOT_IN_CHECKPOINTS = ("rope", "expert_bias", "tokens_per_expert")


def iter_hf_shard_files(
    model_dir: HFModelDir, dtype: torch.dtype | None = None
) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    adapter = model_dir.adapter
    adapter_tensors = adapter.read() if adapter is not None else None
    for path in model_dir.weight_files:
        with safe_open(str(path), framework="pt") as f:
            shard = {key: f.get_tensor(key) for key in f.keys()}
        if adapter is not None:
            shard = adapter.merged(shard, adapter_tensors)
        if dtype is not None:
            shard = {k: v.to(dtype) for k, v in shard.items()}
        yield path, shard


def iter_hf_shards(
    model_dir: HFModelDir, dtype: torch.dtype | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    for _, shard in iter_hf_shard_files(model_dir, dtype):
        yield shard


def read_hf_state_dict(model_dir: HFModelDir, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in iter_hf_shards(model_dir, dtype):
        state.update(shard)
    return state


def _layer_of(key: str) -> str | None:
    match = _LAYER_KEY.match(key)
    return match.group(1) if match else None


class _LayerAssembler:
    """Holds a decoder layer's tensors until all of them have arrived.

    A layer is converted as a whole: fused q/k/v and stacked experts are built from
    several checkpoint tensors, which a shard boundary may split.
    """

    def __init__(self, expected_keys):
        self.needed: dict[str, int] = {}
        for key in expected_keys:
            layer = _layer_of(key)
            if layer is not None:
                self.needed[layer] = self.needed.get(layer, 0) + 1
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return what can be converted now: non-layer tensors and completed layers."""
        ready = {}
        for key, tensor in shard.items():
            layer = _layer_of(key)
            if layer is None or layer not in self.needed:
                ready[key] = tensor
                continue
            group = self.pending.setdefault(layer, {})
            group[key] = tensor
            if len(group) == self.needed[layer]:
                ready.update(self.pending.pop(layer))
        return ready


def load_hf_into_titan(
    model,
    model_config,
    adapter_cls,
    model_dir: HFModelDir,
    dtype: torch.dtype | None,
    expected_keys: set[str] | None = None,
) -> None:
    """Loads the directory's weights into ``model`` (its state-dict keys: ``expected_keys``, if known).

    Listing a materialised model's keys runs torchtitan's state-dict hooks, which split the
    fused q/k/v weights (a copy of every attention weight): callers that built the model on
    the meta device pass the keys they listed there instead.
    """
    from qwen3_titan_common.hf.expected_keys import LM_HEAD, expected_hf_shapes

    # Converted piece by piece, so the tie (lm_head filled from the embedding) is the model's business: it
    # shares one parameter between the two. torchtitan's decoder adapter fills a tied lm_head in every piece
    # and expects the embedding in each, so its pieces are converted untied; transformers' (hf-v5) fills it
    # only in the piece that holds the embedding.
    if hasattr(model_config, "enable_weight_tying"):
        model_config = dataclasses.replace(model_config, enable_weight_tying=False)
    adapter = adapter_cls(model_config, None)
    arch = model_dir.architecture
    expected = expected_keys if expected_keys is not None else set(model.state_dict())
    loaded: set[str] = set()
    assembler = _LayerAssembler(expected_hf_shapes(arch))
    for shard in iter_hf_shards(model_dir, dtype):
        ready = assembler.add(shard)
        del shard
        if not ready:
            continue
        titan_state = adapter.from_hf(ready)
        # assign: the loaded tensors become the parameters, so no second copy is made.
        model.load_state_dict(titan_state, strict=False, assign=True)
        loaded.update(titan_state)
        del ready, titan_state
    if assembler.pending:
        layer, group = next(iter(assembler.pending.items()))
        raise CheckpointError(f"{model_dir.path}: layer {layer} is incomplete ({len(group)} tensors found)")
    if model.enable_weight_tying:
        # Assignment gave each side of the tie a parameter of its own; point lm_head back at the embedding.
        model.lm_head.weight = model.tok_embeddings.weight
        loaded.add(LM_HEAD)
    missing = sorted(k for k in expected - loaded if not any(s in k for s in _NOT_IN_CHECKPOINTS))
    if missing:
        raise CheckpointError(f"{model_dir.path}: not loaded into the {type(model).__name__}: {missing[:8]}")


def cover_tokens(model_config, seq_len: int):
    """``model_config`` (freshly built, changed in place) with RoPE caches for ``seq_len`` tokens: only the
    tokens we will run, not the architecture's whole context."""
    for layer in model_config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    return model_config


def load_titan_model(model_config, adapter_cls, model_dir: HFModelDir, dtype: torch.dtype | None):
    """A torchtitan decoder built from ``model_config``, holding the directory's weights, in eval mode."""
    with torch.device("meta"):
        model = model_config.build()
    expected_keys = set(model.state_dict())  # on meta: no data is split or copied
    # Parameters get storage they never touch (so it is never resident) and are then
    # replaced by the checkpoint's tensors; only computed buffers (RoPE caches) are
    # initialised here, which skips a random init of the whole model.
    model.to_empty(device="cpu")
    init_computed_buffers(model)
    share_rope_caches(model)
    load_hf_into_titan(model, model_config, adapter_cls, model_dir, dtype, expected_keys)
    return model.eval()


def build_titan_qwen3(model_dir: HFModelDir, dtype: torch.dtype = torch.float32, seq_len: int = 2048):
    """torchtitan's Qwen3 shaped by the directory's config.json, holding its weights."""
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec

    spec = titan_qwen3_model_spec(model_dir.architecture, "verify")
    return load_titan_model(cover_tokens(spec.model, seq_len), spec.state_dict_adapter, model_dir, dtype)
