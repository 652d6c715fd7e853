"""Hugging Face checkpoint names <-> ``HFCausalLM`` parameter names.

The model's names are the checkpoint's, with two exceptions, both handled here:

- ``lm_head.weight`` of a tied model is the embedding; published tied checkpoints omit it,
  so ``to_hf`` drops it and ``from_hf`` fills it from ``model.embed_tokens.weight``. An
  untied model keeps it: dropping a trained ``lm_head`` is a silent loss that
  ``Qwen3Trainer``'s export check reports.
- transformers v5 fuses a Qwen3-MoE layer's experts into two 3D parameters,
  ``mlp.experts.gate_up_proj`` (E, 2F, D: gate rows then up rows) and
  ``mlp.experts.down_proj`` (E, D, F), while checkpoints hold one 2D tensor per expert
  and projection (``mlp.experts.{e}.gate_proj.weight`` ...). transformers converts them
  when it loads; this adapter does the same both ways.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from qwen3_titan_common.compat import hf_storage_reader_with_aliases
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.expected_keys import EMBED, LM_HEAD
from qwen3_titan_common.models.qwen3 import with_shard_index
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<kind>gate|up|down)_proj\.weight$")


def split_experts(prefix: str, kind: str, fused: torch.Tensor) -> dict[str, torch.Tensor]:
    """One fused expert tensor -> the checkpoint's per-expert 2D tensors (views)."""
    if kind == "down_proj":  # (E, D, F)
        return {f"{prefix}.{e}.down_proj.weight": fused[e] for e in range(fused.shape[0])}
    ffn = fused.shape[1] // 2  # gate_up_proj (E, 2F, D)
    tensors = {}
    for e in range(fused.shape[0]):
        tensors[f"{prefix}.{e}.gate_proj.weight"] = fused[e, :ffn]
        tensors[f"{prefix}.{e}.up_proj.weight"] = fused[e, ffn:]
    return tensors


def fuse_experts(prefix: str, experts: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert 2D tensors -> transformers v5's two fused tensors."""
    count = max(experts) + 1
    for e in range(count):
        for kind in ("gate", "up", "down"):
            if kind not in experts.get(e, {}):
                raise CheckpointError(
                    f"{prefix}.{e}.{kind}_proj.weight: missing (experts 0..{count - 1} expected)"
                )
    gate_up = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in range(count)])
    down = torch.stack([experts[e]["down"] for e in range(count)])
    return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}


class HFv5StateDictAdapter(StateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None):
        # The shard index only where there is one: torchtitan warns about every folder without (see
        # qwen3_titan_common.models.qwen3.with_shard_index); the path itself stays for its HF reader.
        super().__init__(model_config, with_shard_index(hf_assets_path))
        self.hf_assets_path = hf_assets_path
        self.tied = model_config.tie_word_embeddings
        # Mesh and placements of sharded fused experts, seen by to_hf, restored by from_hf.
        self._expert_layouts: dict[str, tuple[Any, tuple]] = {}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf: dict[str, Any] = {}
        for key, value in state_dict.items():
            if key == LM_HEAD and self.tied:
                continue
            fused = _FUSED_EXPERTS.match(key)
            if fused is None:
                hf[key] = value
                continue
            if isinstance(value, DTensor):
                # Per-expert slices of a shard are not DTensors DCP can read into: work on the
                # full tensor (one layer's experts at a time in an export; all of them in a load).
                self._expert_layouts[key] = (value.device_mesh, tuple(value.placements))
                value = value.full_tensor()
            hf.update(split_experts(fused["prefix"], fused["kind"], value))
        return hf

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for key, value in hf_state_dict.items():
            expert = _EXPERT.match(key)
            if expert is None:
                state[key] = value
            else:
                by_index = experts.setdefault(expert["prefix"], {})
                by_index.setdefault(int(expert["expert"]), {})[expert["kind"]] = value
        for prefix, by_index in experts.items():
            for key, value in fuse_experts(prefix, by_index).items():
                layout = self._expert_layouts.get(key)
                if layout is not None:
                    # Every rank read the same full tensors: each keeps its own shard, no communication.
                    value = distribute_tensor(value, layout[0], list(layout[1]), src_data_rank=None)
                state[key] = value
        if self.tied and LM_HEAD not in state and EMBED in state:
            state[LM_HEAD] = state[EMBED]
        return state

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        if from_quantized:
            raise CheckpointError(f"{path}: quantized checkpoints are not supported by hf-v5-backend")
        if self.tied:
            return HuggingFaceStorageReader(path)
        # A tied checkpoint (no lm_head.weight on disk) read into an untied model: lm_head starts as a
        # copy of the embedding's bytes, and the run trains the two apart. A checkpoint that holds
        # lm_head.weight is read unchanged.
        note = f"tied checkpoint, untied model: {LM_HEAD} starts as a copy of {EMBED}"
        return hf_storage_reader_with_aliases(path, {LM_HEAD: EMBED}, note)
