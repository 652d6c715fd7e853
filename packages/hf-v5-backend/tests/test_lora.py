"""LoRA on the transformers model through peft itself, in process (seconds)."""

from __future__ import annotations

import peft
import torch
from qwen3_titan_common.models.lora import LoRAConverter, lora_state_dict_adapter
from qwen3_titan_hf_v5.model import HFCausalLM
from qwen3_titan_hf_v5.state_dict_adapter import HFv5StateDictAdapter
from qwen3_titan_testing.checkpoints import tiny_qwen3_config
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _lora_model(moe: bool = False) -> tuple[HFCausalLM, HFCausalLM.Config]:
    config = HFCausalLM.Config(hf_config=tiny_qwen3_config(moe=moe).to_dict())
    converted = LoRAConverter.Config(rank=4, alpha=8.0, targets=TARGETS).build().convert(config)
    model = converted.build()
    torch.manual_seed(0)
    model.init_weights(buffer_device=None)
    return model, converted


def test_peft_layers_train_alone_with_peft_s_initialisation():
    model, config = _lora_model()
    assert config.lora is not None and config.lora.targets == TARGETS
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"model.layers.{i}.{module}.lora_{which}.default.weight"
        for i in range(2)
        for module in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
        for which in "AB"
    }
    for name, param in model.named_parameters():
        if ".lora_B." in name:
            assert torch.equal(param, torch.zeros_like(param)), name  # training starts from the base model
        elif ".lora_A." in name:
            bound = 1 / param.shape[1] ** 0.5  # kaiming-uniform with a = sqrt(5)
            assert param.abs().max() <= bound and param.std() > bound / 4, name


def test_base_checkpoint_names_both_ways_and_peft_computes_the_same_model():
    model, config = _lora_model()
    adapter = lora_state_dict_adapter(HFv5StateDictAdapter)(config, None)
    state = model.state_dict()
    hf = adapter.to_hf(state)
    assert "model.layers.0.self_attn.q_proj.weight" in hf and not [
        k for k in hf if "lora_" in k or "base_layer" in k
    ]
    back = adapter.from_hf(hf)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in back and back.keys() <= state.keys()
    # The same weights in a plain transformers model wrapped by peft: the same logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(std=0.1)
    reference = AutoModelForCausalLM.from_config(config.transformers_config())
    reference.load_state_dict(hf, strict=False)
    reference = peft.get_peft_model(reference, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=TARGETS))
    peft.set_peft_model_state_dict(
        reference,
        {
            f"base_model.model.{k.replace('.default', '')}": v
            for k, v in model.state_dict().items()
            if ".lora_" in k
        },
    )
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens), reference.eval()(tokens).logits)
