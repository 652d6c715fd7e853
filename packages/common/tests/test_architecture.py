import copy
import json

import pytest
import torch
from qwen3_titan_common.arch.architecture import (
    ArchitectureError,
    MoEArchitecture,
    Qwen3Architecture,
    architecture_from_config,
    read_architecture,
)
from qwen3_titan_common.arch.published import PUBLISHED_CONFIGS, published_architecture
from qwen3_titan_common.assets import default_architecture, default_model_dir
from qwen3_titan_common.hf.expected_keys import expected_hf_shapes
from transformers import AutoConfig, AutoModelForCausalLM

_A3B_MOE = MoEArchitecture(
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True
)
# What the hand-written parser gave before config.json went through transformers' config classes:
# (hidden, layers, heads, kv heads, head_dim, ffn, vocab, rope theta, context, eps, tied, moe).
_BEFORE = {
    "Qwen3-0.6B": (1024, 28, 16, 8, 128, 3072, 151936, 1e6, 40960, 1e-6, True, None),
    "Qwen3-1.7B": (2048, 28, 16, 8, 128, 6144, 151936, 1e6, 40960, 1e-6, True, None),
    "Qwen3-4B": (2560, 36, 32, 8, 128, 9728, 151936, 1e6, 40960, 1e-6, True, None),
    "Qwen3-4B-Instruct-2507": (2560, 36, 32, 8, 128, 9728, 151936, 5e6, 262144, 1e-6, True, None),
    "Qwen3-8B": (4096, 36, 32, 8, 128, 12288, 151936, 1e6, 40960, 1e-6, False, None),
    "Qwen3-30B-A3B": (2048, 48, 32, 4, 128, 6144, 151936, 1e6, 40960, 1e-6, False, _A3B_MOE),
    "embedded default": (256, 4, 4, 2, 64, 768, 4096, 1e6, 2048, 1e-6, True, None),
}


def _architecture(name):
    return default_architecture() if name == "embedded default" else published_architecture(name)


@pytest.mark.parametrize("name", list(_BEFORE))
def test_published_and_embedded_architectures_are_unchanged(name):
    arch = _architecture(name)
    assert arch == Qwen3Architecture(*_BEFORE[name])
    assert type(arch.rope_theta) is float and type(arch.rms_norm_eps) is float


@pytest.mark.parametrize("name", list(PUBLISHED_CONFIGS))
def test_source_is_the_config_as_given_and_the_config_is_left_alone(name):
    # Exports write `source` back as config.json.
    given = copy.deepcopy(PUBLISHED_CONFIGS[name])
    arch = published_architecture(name)
    assert PUBLISHED_CONFIGS[name] == given
    assert arch.source == given


def test_source_of_the_embedded_default_is_its_config_json():
    written = json.loads((default_model_dir() / "config.json").read_text())
    assert read_architecture(default_model_dir()).source == written


def test_qwen3_4b_instruct_2507_keeps_its_rope_theta_and_context():
    arch = published_architecture("Qwen3-4B-Instruct-2507")
    assert arch.rope_theta == 5_000_000.0
    assert arch.max_position_embeddings == 262_144
    assert published_architecture("Qwen3-4B").rope_theta == 1_000_000.0


def test_rope_parameters_of_transformers_v5_are_read():
    config = {
        **PUBLISHED_CONFIGS["Qwen3-0.6B"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 123.0},
    }
    del config["rope_theta"]
    assert architecture_from_config(config).rope_theta == 123.0


def test_v4_rope_theta_fills_v5_rope_parameters_without_touching_the_callers_dict():
    # transformers' own order: rope_parameters.rope_theta, else the v4 top-level rope_theta.
    config = {
        **PUBLISHED_CONFIGS["Qwen3-0.6B"],
        "rope_theta": 321.0,
        "rope_parameters": {"rope_type": "default"},
    }
    arch = architecture_from_config(config)
    assert arch.rope_theta == 321.0
    assert config["rope_parameters"] == {"rope_type": "default"}
    assert arch.source["rope_parameters"] == {"rope_type": "default"}


def _write(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _transformers_model(model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def _check_rope_and_norm(arch, model):
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv_freq)
    assert model.model.norm.variance_epsilon == arch.rms_norm_eps
    assert model.config.max_position_embeddings == arch.max_position_embeddings


def test_absent_dense_fields_give_the_model_transformers_builds(tmp_path):
    # No head_dim, num_key_value_heads, rope theta, context, eps or tying: each takes transformers' default.
    config = {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 64,
        "intermediate_size": 96, "vocab_size": 128,
    }  # fmt: skip
    model_dir = _write(tmp_path, config)
    arch = read_architecture(model_dir)
    model = _transformers_model(model_dir)

    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes == expected_hf_shapes(arch)
    _check_rope_and_norm(arch, model)
    assert arch.tie_word_embeddings == model.config.tie_word_embeddings
    # Qwen3Config's defaults; the hand-written ones (hidden // heads, as many kv heads as heads) gave (1, 64).
    assert (arch.head_dim, arch.num_key_value_heads) == (128, 32)


def test_absent_moe_fields_give_the_model_transformers_builds(tmp_path):
    # Qwen3MoeConfig has no head_dim (its attention uses hidden // heads) and defaults to 4 kv heads.
    config = {
        "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8,
        "vocab_size": 128, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    }  # fmt: skip
    model_dir = _write(tmp_path, config)
    arch = read_architecture(model_dir)
    model = _transformers_model(model_dir)

    # The hand-written defaults gave as many kv heads as heads (8).
    assert (arch.head_dim, arch.num_key_value_heads) == (8, 4)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # transformers 5 holds a layer's experts fused; on disk (expected_hf_shapes) they are one tensor each.
    fused = {name: shapes.pop(name) for name in list(shapes) if ".mlp.experts." in name}
    expected = {name: s for name, s in expected_hf_shapes(arch).items() if ".mlp.experts." not in name}
    assert shapes == expected
    moe, hidden = arch.moe, arch.hidden_size
    assert fused == {
        "model.layers.0.mlp.experts.gate_up_proj": (moe.num_experts, 2 * moe.moe_intermediate_size, hidden),
        "model.layers.0.mlp.experts.down_proj": (moe.num_experts, hidden, moe.moe_intermediate_size),
    }
    _check_rope_and_norm(arch, model)
    assert moe.norm_topk_prob == model.config.norm_topk_prob


def test_num_local_experts_of_transformers_v5_is_read():
    config = {**PUBLISHED_CONFIGS["Qwen3-30B-A3B"], "num_local_experts": 16}
    del config["num_experts"]
    assert architecture_from_config(config).moe.num_experts == 16


_MOE = "Qwen3-30B-A3B"


@pytest.mark.parametrize(
    ("base", "change", "message"),
    [
        ("Qwen3-0.6B", {"rope_scaling": {"type": "dynamic", "factor": 4.0}}, "field 'rope_scaling'"),
        ("Qwen3-0.6B", {"rope_scaling": {"rope_type": "longrope"}}, "field 'rope_scaling'"),
        ("Qwen3-0.6B", {"rope_scaling": {"rope_type": "yarn"}}, "Qwen3Config refuses it: .*'factor'"),
        (
            "Qwen3-0.6B",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "rope_parameters.rope_type='linear' is not supported",
        ),
        ("Qwen3-0.6B", {"attention_bias": True}, "field 'attention_bias'=True is not supported"),
        ("Qwen3-0.6B", {"use_sliding_window": True}, "field 'use_sliding_window'=True is not supported"),
        ("Qwen3-0.6B", {"hidden_act": "gelu"}, "field 'hidden_act'"),
        ("Qwen3-0.6B", {"model_type": "llama"}, "model_type='llama'"),
        (_MOE, {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]: only all-MoE layers"),
        (_MOE, {"decoder_sparse_step": 2}, "decoder_sparse_step=2, .*only all-MoE layers"),
        (
            "Qwen3-0.6B",
            {"num_key_value_heads": 3},
            "num_attention_heads=16 is not a multiple of num_key_value_heads=3$",
        ),
        (
            "Qwen3-0.6B",
            {"hidden_size": "1024"},
            "Qwen3Config refuses it: Field 'hidden_size' expected int, got str",
        ),
        ("Qwen3-0.6B", {"tie_word_embeddings": 1}, "Field 'tie_word_embeddings' expected bool, got int"),
        (_MOE, {"num_experts": "8"}, "Qwen3MoeConfig refuses it: Field 'num_experts' expected int, got str"),
        ("Qwen3-0.6B", {"head_dim": 7}, "Qwen3Config refuses it: .*`head_dim`=7"),
        (_MOE, {"head_dim": "64"}, "field 'head_dim' is '64', expected a positive integer"),
        ("Qwen3-0.6B", {"rope_theta": "1e6"}, "field 'rope_theta' is '1e6', expected a number"),
        (
            "Qwen3-0.6B",
            {"rope_parameters": {"rope_type": "default", "rope_theta": None}},
            "field 'rope_parameters.rope_theta' is None, expected a number",
        ),
        ("Qwen3-0.6B", {"vocab_size": 0}, "field 'vocab_size' is 0, expected a positive integer"),
        ("Qwen3-0.6B", {"num_key_value_heads": 0}, "field 'num_key_value_heads' is 0, expected a positive"),
    ],
)
def test_fields_we_cannot_honour_are_one_line_errors_naming_the_file_and_field(base, change, message):
    with pytest.raises(ArchitectureError, match=message) as info:
        architecture_from_config({**PUBLISHED_CONFIGS[base], **change}, where="x/config.json")
    assert str(info.value).startswith("x/config.json: ") and "\n" not in str(info.value)


def test_a_default_that_does_not_fit_says_it_is_a_default():
    config = {**PUBLISHED_CONFIGS["Qwen3-0.6B"]}
    del config["num_key_value_heads"]  # transformers' Qwen3Config default: 32 heads, more than 16
    with pytest.raises(ArchitectureError, match="num_key_value_heads=32 .transformers' default"):
        architecture_from_config(config)


@pytest.mark.parametrize(
    ("base", "field"),
    [
        ("Qwen3-0.6B", "hidden_size"),
        ("Qwen3-0.6B", "num_hidden_layers"),
        ("Qwen3-0.6B", "num_attention_heads"),
        ("Qwen3-0.6B", "intermediate_size"),
        ("Qwen3-0.6B", "vocab_size"),
        (_MOE, "num_experts"),
        (_MOE, "num_experts_per_tok"),
        (_MOE, "moe_intermediate_size"),
    ],
)
def test_missing_size_is_named(tmp_path, base, field):
    config = dict(PUBLISHED_CONFIGS[base])
    del config[field]
    with pytest.raises(ArchitectureError, match=rf"config.json: missing required field '{field}'$"):
        read_architecture(_write(tmp_path, config))


def test_missing_config_json_names_the_path(tmp_path):
    with pytest.raises(ArchitectureError, match=f"{tmp_path}/config.json: not found"):
        read_architecture(tmp_path)


@pytest.mark.parametrize(
    ("text", "message"), [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object")]
)
def test_a_config_json_that_is_no_json_object_names_the_path(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ArchitectureError, match=f"{tmp_path}/config.json: {message}"):
        read_architecture(tmp_path)


def test_moe_fields_are_read():
    arch = published_architecture("Qwen3-30B-A3B")
    assert arch.is_moe and arch.moe.num_experts == 128 and arch.moe.num_experts_per_tok == 8


def test_embedded_default_is_a_few_million_parameters():
    arch = default_architecture()
    per_layer = (
        4 * arch.hidden_size * arch.num_attention_heads * arch.head_dim // 2
        + 3 * arch.hidden_size * arch.intermediate_size
    )
    total = arch.vocab_size * arch.hidden_size + arch.num_hidden_layers * per_layer
    assert 1_000_000 < total < 10_000_000
    assert arch.tie_word_embeddings


def test_changed_architecture_describes_itself_in_its_source():
    # An export writes `source` as config.json: a 4-layer cut of a 48-layer model must say 4 layers.
    from qwen3_titan_common.arch.published import published_architecture

    full = published_architecture("Qwen3-30B-A3B")
    cut = full.with_changes(num_hidden_layers=4, tie_word_embeddings=True)
    assert cut.num_hidden_layers == 4 and cut.source["num_hidden_layers"] == 4
    assert cut.source["tie_word_embeddings"] is True and full.source["num_hidden_layers"] == 48
    assert architecture_from_config(cut.source) == cut
    with pytest.raises(ValueError, match="with_changes\\(is_moe=...\\)"):
        full.with_changes(is_moe=False)
