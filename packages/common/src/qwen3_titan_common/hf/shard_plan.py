"""Which tensor goes to which file of an export, decided before any tensor exists.

The split is huggingface_hub's (the one ``save_pretrained`` uses), run on meta tensors
of the shapes the export will receive: it needs only sizes, so the file names, the
index and the total size are known before a trainer gathers the first tensor from
its shards, and each file can be written as soon as its last tensor arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch
from huggingface_hub import StateDictSplit, split_torch_state_dict_into_shards


def plan_shards(
    shapes: Mapping[str, Sequence[int]], dtype: torch.dtype, max_shard_bytes: int
) -> StateDictSplit:
    """Files of at most ``max_shard_bytes`` (a larger tensor gets a file of its own), in ``shapes`` order."""
    meta = {key: torch.empty(tuple(shape), dtype=dtype, device="meta") for key, shape in shapes.items()}
    return split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_bytes)


def index_json(plan: StateDictSplit, shapes: Mapping[str, Sequence[int]]) -> str:
    """``model.safetensors.index.json`` as transformers' ``save_pretrained`` writes it.

    transformers 5 adds ``total_parameters`` to huggingface_hub's ``total_size`` and
    sorts the keys; readers only need the ``weight_map``.
    """
    total_parameters = sum(torch.Size(shape).numel() for shape in shapes.values())
    index = {
        "metadata": {"total_parameters": total_parameters, **plan.metadata},
        "weight_map": plan.tensor_to_filename,
    }
    return json.dumps(index, indent=2, sort_keys=True) + "\n"
