import os
import subprocess
import sys

import pytest
from qwen3_titan_common.compat import CpuDeviceModule
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.runtime import device
from qwen3_titan_common.runtime.device import detect_device


def _no_accelerator() -> bool:
    import torch

    return not torch.cuda.is_available() and not device.neuron_available()


def test_forced_cpu_reports_one_gloo_rank(monkeypatch):
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    info = detect_device()
    assert (info.kind, info.count, info.dist_backend) == ("cpu", 1, "gloo")
    assert "QWEN3_TITAN_DEVICE=cpu" in info.describe()


def test_the_device_is_detected_once_per_process_and_setting(monkeypatch):
    monkeypatch.delenv("QWEN3_TITAN_DEVICE", raising=False)
    first = detect_device()
    calls = []
    monkeypatch.setattr(device, "neuron_available", lambda: calls.append(1) or False)
    monkeypatch.setattr(device, "_cannot_have_an_accelerator", lambda: calls.append(1) or None)
    assert detect_device() is first and not calls  # answered from the first detection
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cpu")
    forced = detect_device()
    assert forced.reason == "QWEN3_TITAN_DEVICE=cpu" and detect_device() is forced


def test_unknown_forced_device_names_the_variable(monkeypatch):
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "tpu")
    with pytest.raises(ValueError, match="QWEN3_TITAN_DEVICE='tpu': expected one of neuron, cuda, cpu"):
        detect_device()


def test_forcing_neuron_without_the_sdk_says_how_to_install(monkeypatch):
    if device.neuron_available():
        pytest.skip("a Neuron device is present: forcing neuron succeeds here")
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "neuron")
    with pytest.raises(
        UserInputError, match="=neuron: this host has no usable Neuron device .*Neuron package rep"
    ):
        detect_device()


def test_forcing_cuda_without_a_gpu_is_a_users_error_not_an_internal_one(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: forcing cuda succeeds here")
    monkeypatch.setenv("QWEN3_TITAN_DEVICE", "cuda")
    with pytest.raises(UserInputError, match="QWEN3_TITAN_DEVICE=cuda: this host has no usable CUDA device"):
        detect_device()


@pytest.mark.skipif(
    not _no_accelerator(), reason="this machine has an accelerator; the CPU fallback is not taken"
)
def test_detection_falls_back_to_cpu_without_accelerators(monkeypatch):
    monkeypatch.delenv("QWEN3_TITAN_DEVICE", raising=False)
    info = detect_device()
    assert info.kind == "cpu" and info.dist_backend == "gloo"


def test_cpu_device_module_reports_host_memory():
    stats = CpuDeviceModule.memory_stats()
    assert stats["reserved_bytes.all.peak"] > 10 * 1024**2  # this process holds torch: > 10 MiB RSS
    assert CpuDeviceModule.get_device_properties().total_memory > stats["reserved_bytes.all.peak"]
    assert CpuDeviceModule.device_count() == 1


@pytest.mark.parametrize(
    "first_import",
    ["import torchtitan.train", "import torchtitan.tools.utils as u"],
    ids=["upstream-entry-torch-first", "torchtitan-utils-first"],
)
def test_torchtitan_sees_cpu_through_torchs_backend_autoload(first_import):
    """A fresh interpreter: the hook is installed by torch's ``torch.backends`` autoload alone, before
    torchtitan's modules copy its device names, whether torch is imported before torchtitan's utils (the
    upstream ``torchtitan.train``) or by them."""
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu"}
    code = (
        f"{first_import}; import torchtitan.tools.utils as u; from torchtitan.distributed import utils as du; "
        "print(u.device_type, u.device_module.__name__, du.device_type)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu", "CpuDeviceModule", "cpu"]
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch's switch: without its autoload, torchtitan's fallback
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "cuda"


def test_the_hook_is_installed_by_importing_torch_and_not_before():
    """No start-up hook in the environment's other processes: only ``import torch`` installs it."""
    code = (
        "import sys\n"
        "def hooked(): return any(type(f).__name__ == '_TorchtitanDeviceHook' for f in sys.meta_path)\n"
        "before = hooked()\n"
        "import torch\n"
        "print(before, hooked())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_device_files_of_every_accelerator_driver_are_found(tmp_path):
    assert device.accelerator_device_files(str(tmp_path)) == []
    for name in ("nvidiactl", "nvidia0", "dxg", "kfd", "neuron3"):
        (tmp_path / name).touch()
    (tmp_path / "null").touch()
    found = device.accelerator_device_files(str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in found) == ["dxg", "kfd", "neuron3", "nvidia0", "nvidiactl"]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or bool(device.accelerator_device_files()),
    reason="the shortcut applies to a Linux host without GPU or Neuron device files",
)
def test_a_host_without_accelerator_device_files_is_cpu_without_importing_torch():
    env = {k: v for k, v in os.environ.items() if k != "QWEN3_TITAN_DEVICE"}
    code = (
        "import sys; from qwen3_titan_common.runtime.device import detect_device; d = detect_device(); "
        "print(d.kind, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu", "False"]
