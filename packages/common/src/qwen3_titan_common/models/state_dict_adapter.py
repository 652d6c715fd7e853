"""torchtitan's Qwen3 state-dict adapter, told about ``hf_assets_path``'s shard index only when it has one.

torchtitan's ``StateDictAdapter.__init__`` reads ``hf_assets_path/model.safetensors.index.json`` to lay out
the HF checkpoints torchtitan itself would save (``--checkpoint.last_save_in_hf``), and warns when the file
is absent. ``hf_assets_path`` is the tokenizer folder of every run that does not start from a sharded
checkpoint, so the warning came with every default run while saying nothing about it: our exports plan
their own shards (``hf.shard_plan``). The path itself is kept, for torchtitan's other reader of it.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter


def with_shard_index(hf_assets_path: str | None) -> str | None:
    """``hf_assets_path`` if it holds a safetensors shard index, else None."""
    if hf_assets_path and (Path(hf_assets_path) / SAFETENSORS_INDEX_FILE).is_file():
        return hf_assets_path
    return None


class Qwen3TitanStateDictAdapter(Qwen3StateDictAdapter):
    def __init__(self, model_config, hf_assets_path: str | None):
        super().__init__(model_config, with_shard_index(hf_assets_path))
        # torchtitan loads HF weights from here when no initial_load_path is given.
        self.hf_assets_path = hf_assets_path
