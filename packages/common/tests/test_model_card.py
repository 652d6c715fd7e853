"""Every export carries a README.md model card, and its index metadata is save_pretrained's."""

from __future__ import annotations

import json

import torch
from huggingface_hub import ModelCard
from qwen3_titan_common.hf.export import ExportSpec, export_hf_dir
from qwen3_titan_common.hf.model_card import CardFacts, model_card, source_hub_id
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

FACTS = CardFacts(
    base_model="/data/Qwen3-0.6B",
    base_model_hub_id="Qwen/Qwen3-0.6B",
    architecture="Qwen3ForCausalLM: 2 layers, hidden 64; 0.6M parameters",
    backend="torchtitan `--module qwen3_titan_native --config debug`",
    data="`/data/chat.jsonl` (chat)",
    step=30,
    total_steps=30,
    loss=5.8712,
    loss_step=30,
    dtype="bfloat16",
    command="uv run --package native-backend train --hf-model /data/Qwen3-0.6B --steps 30",
)


def _tensors(model_dir):
    tensors = {}
    for path in model_dir.weight_files:
        tensors.update(load_file(path))
    return tensors


def test_an_export_has_a_card_that_the_hub_and_transformers_read(tmp_path):
    source = open_model_dir(make_tiny_checkpoint(tmp_path / "src", max_shard_size="200KB"))
    tensors = _tensors(source)
    spec = ExportSpec(
        out_dir=tmp_path / "out" / "hf" / "step-30",
        config=dict(source.architecture.source),
        dtype=torch.float32,
        max_shard_bytes=200_000,
        assets_dir=source.path,
        model_card=str(model_card(FACTS)),
    )
    out = export_hf_dir(spec, tensors.items())
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "Qwen/Qwen3-0.6B" and card.data.library_name == "transformers"
    for fact in (
        "`/data/Qwen3-0.6B`",
        "`/data/chat.jsonl` (chat)",
        "30 of 30",
        "5.8712",
        FACTS.command,
        "bfloat16",
    ):
        assert fact in card.text
    # A run started from this export inherits the Hub id.
    assert source_hub_id(out) == "Qwen/Qwen3-0.6B" and source_hub_id(source.path) is None
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.num_parameters() > 0
    # The index metadata as save_pretrained wrote it for the same tensors and shard size.
    ours = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]
    theirs = json.loads((source.path / "model.safetensors.index.json").read_text())["metadata"]
    assert ours == theirs and set(ours) == {"total_size", "total_parameters"}


def test_a_random_start_and_a_loss_from_an_earlier_step_are_said_so():
    import dataclasses

    facts = dataclasses.replace(FACTS, base_model=None, base_model_hub_id=None, step=35, loss_step=30)
    card = model_card(facts)
    assert card.data.base_model is None
    assert "random initialisation" in card.text and "5.8712 (logged at step 30)" in card.text
