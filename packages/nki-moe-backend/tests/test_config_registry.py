"""Config functions, the recipe's entry point and the trainer they select."""

from importlib.metadata import entry_points

import pytest
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.launcher.config_names import list_config_functions
from qwen3_titan_nki_moe import config_registry
from qwen3_titan_nki_moe.overrides import KERNEL_OVERRIDES
from qwen3_titan_nki_moe.trainer import NkiMoETrainer
from tokenizers import Tokenizer

CONFIGS = ["debug_moe", "qwen3_30b_a3b_4layers", "qwen3_30b_a3b", "qwen3_nki_moe_config"]


def test_config_functions_are_listed():
    assert [f.name for f in list_config_functions("qwen3_titan_nki_moe")] == CONFIGS


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_pick_the_trainer_and_list_the_kernel_overrides(name):
    config = getattr(config_registry, name)()
    assert type(config) is NkiMoETrainer.Config
    assert config.override.imports == list(KERNEL_OVERRIDES)
    assert config.kernels == "auto"
    # torchtitan's Qwen3 checkpoint names (common's subclass only skips a missing shard index).
    assert "Qwen3StateDictAdapter" in [c.__name__ for c in config.model_spec.state_dict_adapter.__mro__]


def test_debug_moe_is_tiny_and_matches_the_embedded_tokenizer():
    config = config_registry.debug_moe()
    arch = config.architecture
    assert arch.is_moe and arch.moe.num_experts == 8 and arch.moe.num_experts_per_tok == 2
    assert arch.num_hidden_layers == 2 and arch.hidden_size == 256
    vocab = Tokenizer.from_file(str(default_tokenizer_dir() / "tokenizer.json")).get_vocab_size()
    assert arch.vocab_size == vocab == 4096


def test_30b_shapes():
    four = config_registry.qwen3_30b_a3b_4layers().architecture
    full = config_registry.qwen3_30b_a3b().architecture
    assert four.num_hidden_layers == 4 and full.num_hidden_layers == 48
    for arch in (four, full):
        assert (
            arch.hidden_size,
            arch.moe.num_experts,
            arch.moe.num_experts_per_tok,
            arch.moe.moe_intermediate_size,
        ) == (
            2048,
            128,
            8,
            768,
        )


def test_the_recipe_name_is_an_entry_point():
    (ep,) = entry_points(group="qwen3_titan.recipes", name="qwen3_nki_moe_config")
    assert ep.value == "qwen3_titan_nki_moe.config_registry:qwen3_nki_moe_config"
    assert type(ep.load()()) is NkiMoETrainer.Config


def test_kernels_is_a_torchtitan_flag():
    from nki_moe_models import parse_debug_moe

    config = parse_debug_moe("--kernels", "reference", "--training.steps", "3")
    assert config.kernels == "reference" and config.training.steps == 3


def test_cuda_graphs_go_off_only_where_the_experts_loop_on_the_host(monkeypatch):
    # On an sm90 GPU the reference grouped GEMM runs F.grouped_mm in bf16 (capturable in a CUDA graph) and a
    # per-expert loop that reads row counts on the host otherwise (seen failing a capture on an H200).
    import torch
    from qwen3_titan_nki_moe.config_registry import debug_moe
    from qwen3_titan_nki_moe.trainer import NkiMoETrainer
    from torchtitan.tools import utils as titan_utils

    monkeypatch.setattr(titan_utils, "device_type", "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for dtype, graphs_off in (("bfloat16", False), ("float32", True)):
        config = debug_moe()
        config.training.mixed_precision_param = dtype
        config = NkiMoETrainer.resolve_cuda_graphs(config)
        assert config.training.disable_cuda_graphs is graphs_off, dtype
    monkeypatch.setattr(titan_utils, "device_type", "cpu")
    config = debug_moe()
    config.training.mixed_precision_param = "float32"
    config = NkiMoETrainer.resolve_cuda_graphs(config)
    # Off on a CPU too, by config: torchtitan would otherwise warn that it runs eagerly there.
    assert config.training.disable_cuda_graphs is True
