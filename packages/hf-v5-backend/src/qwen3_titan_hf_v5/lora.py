"""LoRA on the transformers model through peft itself.

``HFCausalLM`` trains ``AutoModelForCausalLM.from_config(config.json)`` unchanged; with ``--lora.*`` it
trains that model with peft's own LoRA layers, put in by ``peft.inject_adapter_in_model`` before the
model is sharded (on the meta device, as the rest of the model), which also leaves only the adapters
trainable. The adapters are then exactly what ``peft.PeftModel.from_pretrained`` rebuilds from the
exported adapter directory: the same modules, the same names (``q_proj.lora_A.default.weight``; the
base weight is ``q_proj.base_layer.weight``, which common's LoRA state-dict adapter maps to the
checkpoint's ``q_proj.weight``).

A Qwen3-MoE's routed experts are not adapted (common's ``train.lora`` leaves the MLP names out of
the targets): peft would otherwise put adapters on transformers v5's fused expert tensors, which the
other backends cannot train or export.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from qwen3_titan_common.models.lora import LoRAConverter


def inject_lora(causal_lm: nn.Module, lora: LoRAConverter.Config) -> None:
    """Put peft's LoRA layers on ``causal_lm``'s target projections; everything else is frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        bias="none",
    )
    inject_adapter_in_model(config, causal_lm)


def init_adapter_parameter(name: str, param: torch.Tensor) -> bool:
    """peft's initialisation of an adapter parameter (A kaiming-uniform, B zero); False if ``name`` is none."""
    if ".lora_A." in name:
        nn.init.kaiming_uniform_(param, a=math.sqrt(5))
        return True
    if ".lora_B." in name:
        nn.init.zeros_(param)
        return True
    return False
