"""LoRA on torchtitan's Qwen3: the same function as peft's adapters, base frozen, peft's file format.

Fast tests on tiny models built here (real transformers, real peft, real safetensors files); the runs
through the launcher are in the backends' tests (``test_lora_train.py``) and ``tests/test_lora_backends.py``.
"""

import json

import peft
import pytest
import torch
from qwen3_titan_common.compat import init_computed_buffers
from qwen3_titan_common.errors import CheckpointError, UserInputError
from qwen3_titan_common.hf.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterSpec,
    check_adapter_shapes,
    expected_adapter_shapes,
    open_adapter_dir,
    peft_key,
    write_adapter_dir,
)
from qwen3_titan_common.hf.export import EXPORT_MARKER
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.hf.titan_load import load_hf_into_titan
from qwen3_titan_common.models.lora import (
    HF_TARGETS,
    LoRAConverter,
    LoRAParams,
    adapter_key,
    base_weight_name,
    lora_state_dict_adapter,
)
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
from qwen3_titan_common.perf.optimizer_state import describe_trainable, optimizer_state_bytes
from qwen3_titan_common.train.lora import LoRAOptions, check_lora_layout
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from torchtitan.config import ParallelismConfig
from transformers import AutoModelForCausalLM


def _lora_titan(model_dir, targets, rank=4, alpha=8.0):
    """torchtitan's Qwen3 with our adapters, base weights from ``model_dir``, adapters random (not zero)."""
    spec = titan_qwen3_model_spec(model_dir.architecture, "test")
    model_config = (
        LoRAConverter.Config(rank=rank, alpha=alpha, targets=list(targets)).build().convert(spec.model)
    )
    with torch.device("meta"):
        model = model_config.build()
    base_keys = {k for k in model.state_dict() if adapter_key(k) is None}
    model.to_empty(device="cpu")
    init_computed_buffers(model)
    load_hf_into_titan(model, model_config, spec.state_dict_adapter, model_dir, torch.float32, base_keys)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if adapter_key(name) is not None:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval(), spec.state_dict_adapter(model_config, None)


def _as_peft_state(model, sd_adapter) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, value in model.state_dict().items():
        found = adapter_key(name)
        if found is not None:
            (hf_weight,) = sd_adapter.to_hf({f"{found[0]}.weight": value})
            tensors[peft_key(hf_weight.removesuffix(".weight"), found[1])] = value
    return tensors


@pytest.mark.parametrize(
    "moe,targets",
    [
        (False, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
        (False, ["k_proj", "gate_proj"]),
        (True, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    ],
    ids=["dense-q-v-o-up-down", "dense-k-gate", "moe-attention"],
)
def test_fused_qkv_with_separate_adapters_computes_what_peft_computes(tmp_path, moe, targets):
    source = make_tiny_checkpoint(tmp_path / "base", moe=moe)
    model, sd_adapter = _lora_titan(open_model_dir(source), targets)
    tensors = _as_peft_state(model, sd_adapter)
    # One A and one B per targeted projection and layer, q, k and v apart though torchtitan fuses them.
    assert len(tensors) == 2 * 2 * len(targets)
    assert {key.split(".")[-3] for key in tensors} == set(targets)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    reference = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets)).eval()
    result = peft.set_peft_model_state_dict(reference, tensors)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    # Two fp32 implementations of one model (no adapter on the final norm or the output layer).
    bound = ModelBounds.from_dir(source).logit_atol(seq_len=tokens.shape[1])
    assert (ours - theirs).abs().max().item() <= bound
    with torch.no_grad(), reference.disable_adapter():
        assert (ours - reference(tokens).logits).abs().max().item() > 1e-3  # the adapters do change the model


def test_only_adapters_train_and_moe_routing_stays_the_base_models(tmp_path):
    model_dir = open_model_dir(make_tiny_checkpoint(tmp_path / "moe", moe=True))
    spec = titan_qwen3_model_spec(model_dir.architecture, "test")
    model_config = LoRAConverter.Config(rank=2, targets=["q_proj", "o_proj"]).build().convert(spec.model)
    assert all(layer.moe.load_balance_coeff is None for layer in model_config.layers)
    with torch.device("meta"):
        model = model_config.build()
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(adapter_key(name) is not None for name in trainable)
    assert any("qkv_linear.wq.lora_a" in name for name in trainable)
    assert not any(".wk." in name or ".wv." in name or "experts" in name for name in trainable)
    # No load-balancing bias: its update would move the frozen routing.
    assert not [name for name, _ in model.named_buffers() if "expert_bias" in name]


def test_state_dict_adapter_reads_base_checkpoints_for_both_namings(tmp_path):
    model_dir = open_model_dir(make_tiny_checkpoint(tmp_path / "base"))
    spec = titan_qwen3_model_spec(model_dir.architecture, "test")
    adapter = lora_state_dict_adapter(spec.state_dict_adapter)(spec.model, None)
    assert lora_state_dict_adapter(spec.state_dict_adapter) is type(adapter)  # made once
    titan = {
        "layers.0.attention.wo.weight": torch.zeros(1),
        "layers.0.attention.wo.lora_a.weight": torch.zeros(1),
        "layers.0.attention.qkv_linear.wq.lora_b.weight": torch.zeros(1),
    }
    assert list(adapter.to_hf(titan)) == ["model.layers.0.self_attn.o_proj.weight"]
    # peft's layout (hf-v5-backend): base_layer is the checkpoint's plain weight, both ways.
    assert adapter_key("model.layers.1.mlp.up_proj.lora_B.default.weight") == (
        "model.layers.1.mlp.up_proj",
        "B",
    )
    assert (
        base_weight_name("model.layers.1.mlp.up_proj.base_layer.weight")
        == "model.layers.1.mlp.up_proj.weight"
    )
    assert adapter_key("model.layers.1.mlp.up_proj.base_layer.weight") is None


def _adapter(tmp_path, arch, targets=("q_proj", "v_proj"), rank=2, **params):
    shapes = expected_adapter_shapes(arch, targets, rank)
    tensors = {key: torch.randn(shape) for key, shape in shapes.items()}
    spec = AdapterSpec(
        out_dir=tmp_path / "adapter",
        params=LoRAParams(rank=rank, alpha=params.get("alpha", 4.0), dropout=params.get("dropout", 0.1)),
        target_modules=tuple(targets),
        base_model="/some/base",
        step=7,
    )
    return write_adapter_dir(spec, tensors), tensors, shapes


def test_adapter_directory_is_peft_s_format_and_reads_back(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "base")
    arch = open_model_dir(source).architecture
    out, tensors, shapes = _adapter(tmp_path, arch)
    # peft's two files, the note, and the mark that this project wrote it (a later export may replace it).
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [EXPORT_MARKER, "README.md", ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    )
    assert not list(tmp_path.glob(".adapter.partial-*"))
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["task_type"]) == (
        "LORA",
        2,
        4.0,
        "CAUSAL_LM",
    )
    assert (
        sorted(config["target_modules"]) == ["q_proj", "v_proj"]
        and config["base_model_name_or_path"] == "/some/base"
    )
    assert "/some/base" in (out / "README.md").read_text()
    # peft itself loads it onto the base model, every tensor where we put it.
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), str(out))
    loaded = peft.get_peft_model_state_dict(model)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[key], tensors[key]) for key in tensors)
    opened = open_adapter_dir(out)
    assert opened.params == LoRAParams(rank=2, alpha=4.0, dropout=0.1)
    assert opened.target_modules == ("q_proj", "v_proj") and opened.base_model == "/some/base"
    check_adapter_shapes(opened, shapes)
    assert (ADAPTER_CONFIG, ADAPTER_WEIGHTS) == (peft.utils.CONFIG_NAME, peft.utils.SAFETENSORS_WEIGHTS_NAME)


def test_bad_adapter_directories_get_one_line(tmp_path):
    arch = open_model_dir(make_tiny_checkpoint(tmp_path / "base")).architecture
    out, _, shapes = _adapter(tmp_path, arch)
    with pytest.raises(CheckpointError, match=r"--lora.adapter .*nowhere: no adapter_config.json there"):
        open_adapter_dir(tmp_path / "nowhere")
    wrong = dict(shapes)
    wrong["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] = (64, 3)
    with pytest.raises(
        CheckpointError,
        match=r"layers.1.self_attn.v_proj.lora_B.weight has shape \[64, 2\], expected \[64, 3\]",
    ):
        check_adapter_shapes(open_adapter_dir(out), wrong)
    with pytest.raises(CheckpointError, match=r"no tensor .*k_proj\.lora_A\.weight"):
        check_adapter_shapes(
            open_adapter_dir(out), expected_adapter_shapes(arch, ("q_proj", "k_proj", "v_proj"), 2)
        )
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    (out / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(CheckpointError, match=r"adapter_config.json: use_rslora is True; expected False"):
        open_adapter_dir(out)
    (out / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_modules": ".*proj"}))
    with pytest.raises(CheckpointError, match=r"target_modules '.\*proj'; expected a list"):
        open_adapter_dir(out)
    # Values the --lora.* flags would refuse, named in the file they come from (they replace the flags').
    for key, value, message in [
        (
            "target_modules",
            ["q_proj", "embed_tokens"],
            r"target_modules names embed_tokens; expected Qwen3 projections",
        ),
        ("r", 0, r"adapter_config.json: r 0; expected a positive rank"),
        ("lora_alpha", -1.0, r"adapter_config.json: lora_alpha -1.0; expected a positive number"),
        ("lora_dropout", 1.0, r"adapter_config.json: lora_dropout 1.0; expected a probability in \[0, 1\)"),
    ]:
        (out / ADAPTER_CONFIG).write_text(json.dumps({**config, key: value}))
        with pytest.raises(CheckpointError, match=message):
            open_adapter_dir(out)
    (out / ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
    (out / ADAPTER_CONFIG).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: not a readable safetensors file"):
        open_adapter_dir(out)


def test_lora_flags_are_checked_in_one_line():
    """The section checks its own fields as it is parsed; the layout is checked by the run's resolve."""
    LoRAOptions(rank=8, alpha=1.0, dropout=0.5, targets=["q_proj"])
    check_lora_layout(ParallelismConfig())
    for changes, message in [
        ({"rank": -1}, r"--lora.rank -1: expected a positive rank"),
        ({"rank": 8, "alpha": 0.0}, r"--lora.alpha 0.0: expected a positive number"),
        ({"rank": 8, "dropout": 1.0}, r"--lora.dropout 1.0: expected a probability in \[0, 1\)"),
        (
            {"rank": 8, "targets": ["q_proj", "qkv"]},
            r"--lora.targets q_proj,qkv: expected some of q_proj,k_proj",
        ),
        ({"rank": 8, "targets": []}, r"--lora.targets : expected some of q_proj,k_proj"),
        ({"merge": True}, r"--lora.merge True: has no effect without --lora.rank R or --lora.adapter DIR"),
        ({"targets": ["q_proj"]}, r"--lora.targets q_proj: has no effect without --lora.rank R"),
    ]:
        with pytest.raises(UserInputError, match=message):
            LoRAOptions(**changes)
    with pytest.raises(
        UserInputError, match=r"--parallelism.tensor_parallel_degree 2: LoRA runs shard with FSDP2"
    ):
        check_lora_layout(ParallelismConfig(tensor_parallel_degree=2))
    assert not LoRAOptions().enabled and LoRAOptions(adapter="x").enabled
    assert LoRAOptions().targets == list(HF_TARGETS)


def test_expected_adapter_shapes_follow_the_architecture(tmp_path):
    dense = open_model_dir(make_tiny_checkpoint(tmp_path / "dense")).architecture
    shapes = expected_adapter_shapes(dense, ("k_proj", "down_proj"), 3)
    assert shapes["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"] == (3, 64)
    assert shapes["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"] == (64, 3)
    assert shapes["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] == (3, 128)
    assert len(shapes) == 2 * 2 * 2
    moe = open_model_dir(make_tiny_checkpoint(tmp_path / "moe", moe=True)).architecture
    assert not expected_adapter_shapes(moe, ("gate_proj",), 3)  # experts are never adapted


def test_optimizer_state_is_counted_from_what_trains():
    frozen, trained = torch.nn.Linear(100, 10), torch.nn.Linear(10, 10, bias=False)
    frozen.requires_grad_(False)
    model = torch.nn.Sequential(frozen, trained)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    assert optimizer_state_bytes([adamw]) == 2 * 100 * 4
    assert optimizer_state_bytes([torch.optim.AdamW(trained.parameters(), amsgrad=True)]) == 3 * 100 * 4
    assert optimizer_state_bytes([torch.optim.SGD(trained.parameters())]) == 0
    assert optimizer_state_bytes([torch.optim.Adadelta(trained.parameters())]) is None
    line = describe_trainable([model], [adamw])
    assert line.startswith("[params] trainable 100 of 1,110 (9.01%); optimizer state per rank 800 bytes")
    # After a step the optimizer holds exactly that much per-element state.
    model(torch.randn(2, 100)).sum().backward()
    adamw.step()
    held = sum(t.numel() * t.element_size() for s in adamw.state.values() for t in s.values() if t.dim() > 0)
    assert held == optimizer_state_bytes([adamw])
