"""One place that decides which device this process trains on.

Order: Neuron (``torch_neuronx`` imports and ``torch.neuron.is_available()``), then CUDA,
then CPU. A Linux host without the device files that the NVIDIA, AMD, WSL and Neuron drivers create
(``/dev/nvidiactl``, ...), or a Mac, can have neither: it is a CPU host without importing torch, which
the launcher would otherwise pay (a second on a small machine) before torchrun can start.

torchtitan 0.3.0 has no CPU device type: at import time it falls back to
"cuda", so on a CPU host we replace its ``device_type``/``device_module`` with
``cpu`` and ``compat.CpuDeviceModule`` right after ``torchtitan.tools.utils`` executes, before any
other torchtitan module copies those names (see ``device_autoload``).

``QWEN3_TITAN_DEVICE=cpu`` forces the CPU path on an accelerator host (tests, parity).
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import sys
from dataclasses import dataclass

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.runtime.neuron_sdk import NEURON_DEVICES, missing_sdk_note

logger = logging.getLogger(__name__)

FORCE_DEVICE_ENV = "QWEN3_TITAN_DEVICE"

# Distributed backend per device kind. torchtitan looks the device type up in
# torch.distributed.Backend.default_device_backend_map; the Neuron plugin registers
# its "neuron" backend there itself.
DIST_BACKENDS = {"neuron": "neuron", "cuda": "nccl", "cpu": "gloo"}

# What a CUDA or Neuron device needs on Linux: NVIDIA's control device, WSL's GPU paravirtualisation,
# ROCm's kernel driver (torch.cuda on AMD), the Neuron driver's devices.
ACCELERATOR_DEVICE_FILES = ("nvidiactl", "nvidia[0-9]*", "dxg", "kfd", os.path.basename(NEURON_DEVICES))


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "neuron" | "cuda" | "cpu"
    count: int  # ranks one node can run: NeuronCores, GPUs, or 1 on CPU
    dist_backend: str
    name: str
    reason: str  # why this device was chosen, for the one log line

    def describe(self) -> str:
        return (
            f"device: {self.kind} x{self.count} ({self.name}), "
            f"distributed backend: {self.dist_backend} — {self.reason}"
        )


def neuron_available() -> bool:
    """True only when the real TorchNeuron plugin is importable and sees a device.

    PyPI's ``torch-neuronx`` is a placeholder that raises ImportError, and the legacy
    XLA build imports but has no ``torch.neuron``; ``find_spec`` or version checks
    cannot tell these apart, so we import and ask.
    """
    try:
        import torch_neuronx  # noqa: F401
    except Exception:  # ImportError, or OSError from a missing libnrt
        return False
    import torch

    neuron = getattr(torch, "neuron", None)
    try:
        return bool(neuron is not None and neuron.is_available() and neuron.device_count() > 0)
    except Exception:
        return False


def _forced_device(setting: str) -> str | None:
    forced = setting.strip().lower()
    if not forced:
        return None
    if forced not in DIST_BACKENDS:
        raise UserInputError(f"{FORCE_DEVICE_ENV}={forced!r}: expected one of {', '.join(DIST_BACKENDS)}")
    return forced


def accelerator_device_files(dev: str = "/dev") -> list[str]:
    """The device files of this host through which a CUDA or Neuron device could be reached."""
    return sorted(path for pattern in ACCELERATOR_DEVICE_FILES for path in glob.glob(f"{dev}/{pattern}"))


def _cannot_have_an_accelerator() -> str | None:
    """Why this host has no CUDA or Neuron device, known without importing torch; None when it may."""
    if sys.platform == "darwin":
        return "macOS: no CUDA or Neuron device"
    if sys.platform.startswith("linux") and not accelerator_device_files():
        return "no Neuron or CUDA device found (no GPU or Neuron device files in /dev)"
    return None


def detect_device() -> DeviceInfo:
    """The device this process trains on: Neuron, then CUDA, then the CPU (``QWEN3_TITAN_DEVICE`` forces one).

    Detected once per process for each value of the variable: a device does not come or go while a process
    runs, and asking the Neuron runtime or the CUDA driver again costs a call each of the several places that
    need the answer (the launcher's plan, the device hook, the config functions, the kernel registry).
    """
    return _detected(os.environ.get(FORCE_DEVICE_ENV, ""))


@functools.cache
def _detected(forced_setting: str) -> DeviceInfo:
    forced = _forced_device(forced_setting)
    if forced == "cpu":
        return _cpu_info(f"{FORCE_DEVICE_ENV}=cpu")
    if forced is None:
        reason = _cannot_have_an_accelerator()
        if reason is not None:
            return _cpu_info(reason)
    import torch

    if forced in (None, "neuron") and neuron_available():
        count = torch.neuron.device_count()
        name = _neuron_name()
        return DeviceInfo("neuron", count, "neuron", name, "torch_neuronx imported, Neuron device present")
    if forced == "neuron":
        raise UserInputError(
            f"{FORCE_DEVICE_ENV}=neuron: this host has no usable Neuron device (torch-neuronx, neuronx-cc and nki "
            "come from the Neuron package repository, README: 'On a Trainium host'); unset it, or "
            f"{FORCE_DEVICE_ENV}=cpu"
        )
    if torch.cuda.is_available():
        return DeviceInfo(
            "cuda", torch.cuda.device_count(), "nccl", torch.cuda.get_device_name(0), "CUDA available"
        )
    if forced == "cuda":
        raise UserInputError(
            f"{FORCE_DEVICE_ENV}=cuda: this host has no usable CUDA device (torch.cuda.is_available() is False); "
            f"unset it, or {FORCE_DEVICE_ENV}=cpu"
        )
    return _cpu_info(missing_sdk_note() or "no Neuron or CUDA device found")


def _neuron_name() -> str:
    import torch

    try:
        return str(torch.neuron.get_device_properties().name)
    except Exception:
        return "neuron"


def _cpu_info(reason: str) -> DeviceInfo:
    return DeviceInfo("cpu", 1, "gloo", "cpu", reason)


def patch_torchtitan_utils(utils_module) -> DeviceInfo:
    """Point torchtitan's import-time device globals at the detected device.

    Called on ``torchtitan.tools.utils`` right after it executes. Only the CPU case
    needs a change: torchtitan already finds CUDA, and Neuron through PrivateUse1.
    """
    info = detect_device()
    if info.kind == "cpu":
        from qwen3_titan_common.compat import use_cpu_device

        use_cpu_device(utils_module)
    return info
