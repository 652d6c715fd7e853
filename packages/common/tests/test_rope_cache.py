"""One RoPE cache for all of a model's layers (``models.qwen3.share_rope_caches``): torchtitan gives each layer a
cache of its own, identical copies that cost a long row's job gigabytes a rank."""

from __future__ import annotations

import torch
from qwen3_titan_common.assets import default_architecture
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config
from torchtitan.models.common import CosSinRoPE

YARN = {"factor": 4.0, "original_max_position_embeddings": 512}


def _initialised(arch):
    with torch.device("meta"):
        model = titan_qwen3_model_config(arch).build()
    model.to_empty(device="cpu")
    model.init_states()
    return model


def _caches(model) -> list[torch.Tensor]:
    return [layer.attention.rope.cache for layer in model.layers.values()]


def test_every_layer_holds_one_cache_with_torchtitans_values():
    arch = default_architecture()
    caches = _caches(_initialised(arch))
    assert len(caches) == arch.num_hidden_layers > 1
    assert len({cache.data_ptr() for cache in caches}) == 1
    # Still torchtitan's own RoPE config, which --override.imports factories target exactly.
    assert type(titan_qwen3_model_config(arch).first_attention.rope) is CosSinRoPE.Config
    # One per model: torchtitan annotates each model's buffers with that model's device mesh.
    assert _caches(_initialised(arch))[0].data_ptr() != caches[0].data_ptr()
    config = CosSinRoPE.Config(
        dim=arch.head_dim, max_seq_len=arch.max_position_embeddings, theta=arch.rope_theta
    )
    assert torch.equal(caches[0], CosSinRoPE(config).cache)


def test_yarn_scales_the_shared_cache_and_another_config_gets_its_own():
    from qwen3_titan_common.arch.architecture import architecture_from_config

    plain = default_architecture()
    yarn_arch = architecture_from_config({**plain.source, "rope_scaling": {"rope_type": "yarn", **YARN}})
    yarn, base = _caches(_initialised(yarn_arch)), _caches(_initialised(plain))
    assert len({cache.data_ptr() for cache in yarn}) == 1
    assert yarn[0].data_ptr() != base[0].data_ptr()
    factor = yarn_arch.yarn.attention_factor
    assert factor > 1.0
    rope = yarn_arch.yarn
    unscaled = CosSinRoPE(
        CosSinRoPE.Config(
            dim=plain.head_dim,
            max_seq_len=plain.max_position_embeddings,
            theta=plain.rope_theta,
            scaling="yarn",
            rope_factor=rope.factor,
            beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow,
            original_seq_len=rope.original_max_position_embeddings,
            truncate=rope.truncate,
        )
    ).cache
    assert torch.equal(yarn[0], unscaled * factor)
