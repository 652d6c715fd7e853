"""The shared launcher with the native backend's real config registry."""

import shlex

from qwen3_titan_common.launcher.launch import run
from qwen3_titan_native import BACKEND as NATIVE

RECIPE_FLAGS = ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--local-ranks-filter", "0"]


def test_print_cmd_is_the_upstream_torchrun_command_with_flags_passed_through(capsys):
    assert (
        run(NATIVE, ["--print-cmd", "--nproc", "64", "--training.steps", "5", "--config", "native_qwen3_4b"])
        == 0
    )
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:2] == ["torchrun", "--nproc_per_node=64"]
    assert argv[2:8] == RECIPE_FLAGS
    assert argv[8:12] == ["--role", "rank", "--tee", "3"]
    assert argv[12:] == [
        "-m", "torchtitan.train", "--module", "qwen3_titan_native", "--config", "native_qwen3_4b",
        "--training.steps", "5",
    ]  # fmt: skip


def test_unknown_config_lists_the_available_ones_and_fails(capsys):
    assert run(NATIVE, ["--nproc", "1", "--config", "qwen3_5t"]) == 2
    err = capsys.readouterr().err
    assert "--config qwen3_5t: not a config function of qwen3_titan_native" in err
    assert "debug, qwen3_0_6b, qwen3_1_7b, qwen3_4b, qwen3_8b, native_qwen3_4b" in err


def test_list_configs_shows_names_and_summaries(capsys):
    assert run(NATIVE, ["--list-configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [
        "debug", "qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b", "native_qwen3_4b",
    ]  # fmt: skip
    assert "Qwen3-4B-Instruct-2507" in lines[-1]


def test_real_size_configs_compile_on_cuda_and_the_tiny_one_never(monkeypatch):
    # The fastest measured configuration on an H200 (docs/performance.md) is per-block compile.
    from qwen3_titan_common.runtime import device
    from qwen3_titan_native import config_registry

    for kind, compiled in (("cuda", True), ("cpu", False), ("neuron", False)):
        info = device.DeviceInfo(kind, 1, device.DIST_BACKENDS[kind], kind, "test")
        monkeypatch.setattr(device, "detect_device", lambda info=info: info)
        assert config_registry.qwen3_1_7b().compile.enable is compiled, kind
        assert config_registry.native_qwen3_4b().compile.enable is compiled, kind
        assert config_registry.debug().compile.enable is False, kind


def test_the_registry_s_configs_record_their_module_and_name():
    from qwen3_titan_native import config_registry

    assert config_registry.debug().config_function == ("qwen3_titan_native", "debug")
    assert config_registry.native_qwen3_4b().config_function == ("qwen3_titan_native", "native_qwen3_4b")
