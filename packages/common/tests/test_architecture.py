import json

import pytest
from qwen3_titan_common.arch.architecture import (
    ArchitectureError,
    architecture_from_config,
    read_architecture,
)
from qwen3_titan_common.arch.published import PUBLISHED_CONFIGS, published_architecture
from qwen3_titan_common.assets import default_architecture


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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "field 'rope_scaling'"),
        ({"attention_bias": True}, "field 'attention_bias'"),
        ({"hidden_act": "gelu"}, "field 'hidden_act'"),
        ({"model_type": "llama"}, "model_type='llama'"),
        ({"hidden_size": "1024"}, "field 'hidden_size' is '1024', expected int"),
    ],
)
def test_fields_we_cannot_honour_are_errors_naming_the_field(change, message):
    with pytest.raises(ArchitectureError, match=message):
        architecture_from_config({**PUBLISHED_CONFIGS["Qwen3-0.6B"], **change})


def test_missing_field_is_named(tmp_path):
    config = dict(PUBLISHED_CONFIGS["Qwen3-0.6B"])
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArchitectureError, match=r"config.json: missing required field 'vocab_size'"):
        read_architecture(tmp_path)


def test_missing_config_json_names_the_path(tmp_path):
    with pytest.raises(ArchitectureError, match=f"{tmp_path}/config.json: not found"):
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
