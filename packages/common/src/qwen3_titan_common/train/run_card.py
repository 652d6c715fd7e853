"""A run's facts for its exports' model cards (``hf.model_card``): where the weights came from, how they trained.

The command line is the one the user typed, which the ``train`` launcher passes to the ranks
(``--launcher.command``); under a bare ``torchrun`` it is the rank's own ``-m torchtitan.train`` arguments.
"""

from __future__ import annotations

import re
import shlex
import sys

import torch

from qwen3_titan_common.hf.expected_keys import LM_HEAD, expected_hf_shapes
from qwen3_titan_common.hf.model_card import CardFacts, model_card, source_hub_id

_HUB_DOWNLOAD = re.compile(r"\bhf download (\S+)")


def _architecture(arch) -> str:
    shapes = expected_hf_shapes(arch)
    if arch.tie_word_embeddings:
        shapes.pop(LM_HEAD, None)
    parameters = sum(torch.Size(shape).numel() for shape in shapes.values())
    kind = (
        arch.source.get("architectures") or ["Qwen3MoeForCausalLM" if arch.is_moe else "Qwen3ForCausalLM"]
    )[0]
    experts = f", {arch.moe.num_experts} experts (top {arch.moe.num_experts_per_tok})" if arch.is_moe else ""
    size = f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.1f}M"
    return f"{kind}: {arch.num_hidden_layers} layers, hidden {arch.hidden_size}{experts}; {size} parameters"


def _data(config) -> str:
    dataset = getattr(config.dataloader, "dataset", None)
    if dataset is None:
        return type(config.dataloader).__qualname__
    if dataset == "default":
        return "the embedded corpus (CPython standard-library docstrings; qwen3-titan's default)"
    fmt = getattr(config.dataloader, "format", "auto")
    return f"`{dataset}`" + (f" ({fmt})" if fmt != "auto" else "")


def _objective(config) -> str:
    if getattr(config, "objective", "sft") != "dpo":
        return "next-token prediction (supervised fine-tuning)"
    return f"DPO on preference pairs: {config.dpo.describe()}; reference: {config.dpo.describe_reference()}"


def _command(config) -> str:
    return config.launcher.command or shlex.join(["torchrun", "...", "-m", "torchtitan.train", *sys.argv[1:]])


def run_card(trainer, step: int) -> str:
    """The model card text of an export of ``trainer``'s model at ``step``."""
    config, start, progress = trainer.config, trainer._start, trainer.metrics_processor.progress
    model_dir = start.model_dir.path if start.model_dir is not None else config.hf.model_dir
    hub_id = source_hub_id(model_dir)
    if hub_id is None and config.hf.download_hint:
        match = _HUB_DOWNLOAD.search(config.hf.download_hint)
        hub_id = match.group(1) if match else None
    built_by = config.config_function
    backend = (
        f"torchtitan `--module {built_by[0]} --config {built_by[1]}`"
        if built_by
        else type(trainer).__qualname__
    )
    facts = CardFacts(
        base_model=str(model_dir) if model_dir else None,
        base_model_hub_id=hub_id,
        architecture=_architecture(config.architecture),
        backend=backend,
        data=_data(config),
        step=step,
        total_steps=config.training.steps,
        loss=progress.final_loss,
        loss_step=progress.last_step,
        dtype=str(trainer.checkpointer.hf_export.dtype).removeprefix("torch."),
        command=_command(config),
        objective=_objective(config),
    )
    return str(model_card(facts))
