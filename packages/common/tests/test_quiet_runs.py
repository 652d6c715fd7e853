"""Each warning the default run used to print, turned off where it starts, and still there where it applies."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from qwen3_titan_common.runtime import quiet


def test_torchruns_nccl_setting_is_dropped_on_gloo_only():
    env = {quiet.NCCL_ASYNC_ERROR_HANDLING: "1", "OTHER": "x"}
    assert not quiet.drop_nccl_settings_on_gloo("cuda", env) and env[quiet.NCCL_ASYNC_ERROR_HANDLING] == "1"
    assert quiet.drop_nccl_settings_on_gloo("cpu", env) and env == {"OTHER": "x"}


def test_torchdata_still_calls_set_vital_and_only_that_warning_is_ignored():
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        StatefulDataLoader([1, 2, 3])
    # If torchdata stops calling it, this seam can go.
    assert any("'set_vital' is deprecated" in str(w.message) for w in seen)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.quiet_torchdata_set_vital()
        StatefulDataLoader([1, 2, 3])
        warnings.warn("'set_vital' is deprecated, please do not call", UserWarning, stacklevel=1)
    # Ignored from torchdata; the same words from anywhere else still come through.
    assert [str(w.message) for w in seen] == ["'set_vital' is deprecated, please do not call"]


def _router_warnings(quiet_first=None) -> list[str]:
    """The CPU autocast warnings of torchtitan's real MoE router on fp32 tokens (after ``quiet_first()``)."""
    from torchtitan.models.common.config_utils import make_router_config

    router = make_router_config(dim=16, num_experts=4, gate_param_init={}, top_k=2, score_func="softmax")
    module = router.build()
    torch.nn.init.normal_(module.gate.weight)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if quiet_first is not None:
            quiet_first()
        module(torch.randn(1, 8, 16))
        warnings.warn("In CPU autocast, but the target dtype is not supported", UserWarning, stacklevel=1)
    return [str(w.message) for w in seen if "target dtype is not supported" in str(w.message)]


def test_the_routers_cpu_autocast_warning_is_quiet_on_the_cpu_only():
    # torchtitan's router warns on the CPU, and one more from elsewhere (the test's own) always comes through.
    assert len(_router_warnings()) == 2, (
        "torchtitan's router no longer warns: quiet_router_autocast_on_cpu can go"
    )
    assert len(_router_warnings(lambda: quiet.quiet_router_autocast_on_cpu("cuda"))) == 2
    assert len(_router_warnings(lambda: quiet.quiet_router_autocast_on_cpu("cpu"))) == 1


@pytest.fixture
def one_rank_cpu_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


def _rng_warnings(mesh, quiet_first=None) -> list[str]:
    """The DTensor RNG warnings of a real random op on a DTensor of ``mesh`` (after ``quiet_first()``)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tensor = distribute_tensor(torch.empty(4, 4), mesh, [Shard(0)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if quiet_first is not None:
            quiet_first()
        torch.nn.init.normal_(tensor)
    return [str(w.message) for w in seen if "DTensor random operators" in str(w.message)]


def test_dtensor_rng_warning_is_quiet_on_one_cpu_rank_only(one_rank_cpu_mesh):
    assert _rng_warnings(one_rank_cpu_mesh), "torch no longer warns: quiet_dtensor_rng_on_one_cpu_rank can go"
    # Several CPU ranks: it applies, it stays.
    assert _rng_warnings(
        one_rank_cpu_mesh, lambda: quiet.quiet_dtensor_rng_on_one_cpu_rank("cpu", world_size=2)
    )
    assert (
        _rng_warnings(one_rank_cpu_mesh, lambda: quiet.quiet_dtensor_rng_on_one_cpu_rank("cpu", world_size=1))
        == []
    )


def test_the_tokenizer_folder_is_no_shard_index_news(tmp_path, caplog):
    from qwen3_titan_common.assets import default_architecture, default_tokenizer_dir
    from qwen3_titan_common.models.qwen3 import Qwen3TitanStateDictAdapter, titan_qwen3_model_config
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    model_config = titan_qwen3_model_config(default_architecture())
    tokenizer_dir = str(default_tokenizer_dir())
    with caplog.at_level(logging.WARNING):
        Qwen3StateDictAdapter(model_config, tokenizer_dir)
    assert "model.safetensors.index.json not found" in caplog.text  # upstream still warns: the seam is needed
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        adapter = Qwen3TitanStateDictAdapter(model_config, tokenizer_dir)
    assert caplog.records == [] and adapter.hf_assets_path == tokenizer_dir
    # A folder that has an index still gives torchtitan its layout.
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}'
    )
    assert Qwen3TitanStateDictAdapter(model_config, str(tmp_path)).fqn_to_index_mapping == {
        "model.norm.weight": 2
    }


def test_no_initial_load_path_is_no_news(caplog):
    from qwen3_titan_common.components.checkpoint import Qwen3CheckpointManager
    from torchtitan.components.checkpoint import CheckpointManager

    with caplog.at_level(logging.WARNING):
        CheckpointManager.Config()
    assert "initial_load_model_only=True has no effect" in caplog.text  # torchtitan's default still warns
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ours = Qwen3CheckpointManager.Config()
    assert caplog.records == [] and not ours.initial_load_model_only
    # Loading HF weights still asks for model-only, as torchtitan requires.
    with pytest.raises(ValueError, match="initial_load_in_hf requires initial_load_model_only"):
        Qwen3CheckpointManager.Config(initial_load_in_hf=True, initial_load_path="/x")


def test_cuda_graphs_are_off_without_cuda():
    from qwen3_titan_common.assets import default_architecture
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
    from qwen3_titan_common.train.config_functions import BackendConfigs
    from qwen3_titan_common.train.trainer import Qwen3Trainer
    from torchtitan.tools import utils as titan_utils

    assert titan_utils.device_type == "cpu"  # the device hook (QWEN3_TITAN_DEVICE=cpu or no accelerator)
    config = BackendConfigs("t", titan_qwen3_model_spec).tiny(default_architecture(), "debug")
    # Off as the config is made (Qwen3Trainer.Config.__post_init__): torchtitan's parse-time check of CUDA
    # graphs against the layout (pipeline, expert parallel dispatchers) then has nothing to refuse.
    assert config.training.disable_cuda_graphs
    assert Qwen3Trainer.resolve_cuda_graphs(config) is config
    parallel = dataclasses.replace(config.parallelism, expert_parallel_degree=2, pipeline_parallel_degree=2)
    assert dataclasses.replace(config, parallelism=parallel).training.disable_cuda_graphs
