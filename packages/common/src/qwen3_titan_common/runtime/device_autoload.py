"""The torchtitan device shim, installed before torchtitan detects its device: :func:`register` is
``common``'s ``torch.backends`` entry point, which PyTorch's device-backend autoload calls at the end of
``import torch`` in every process that imports torch (as TorchNeuron registers ``neuron``), the ranks of
the upstream ``torchrun ... -m torchtitan.train`` included. It adds an import hook, nothing else, which runs
the device detection right after ``torchtitan.tools.utils`` executes, before another torchtitan module
copies its ``device_type``/``device_module`` (when that module's own ``import torch`` ran the entry point:
at the first import after it has run). ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns both off.
"""

from __future__ import annotations

import importlib.abc
import sys

TARGET_MODULE = "torchtitan.tools.utils"


def _patch(utils_module) -> None:
    from qwen3_titan_common.runtime.device import patch_torchtitan_utils

    patch_torchtitan_utils(utils_module)


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module) -> None:
        self._wrapped.exec_module(module)
        _patch(module)


class _TorchtitanDeviceHook(importlib.abc.MetaPathFinder):
    def __init__(self, executing_utils=None) -> None:
        self._executing_utils = executing_utils  # the module whose ``import torch`` ran the entry point

    def find_spec(self, fullname, path, target=None):
        utils = self._executing_utils
        if utils is not None and hasattr(utils, "device_module"):
            self._executing_utils = None  # first: _patch's import comes back through this method
            _patch(utils)
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _PatchAfterExec(spec.loader)
                    return spec
        return None


def register() -> None:
    """The ``torch.backends`` entry point."""
    if not any(isinstance(f, _TorchtitanDeviceHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchtitanDeviceHook(executing_utils=sys.modules.get(TARGET_MODULE)))


def ensure_installed() -> None:
    """Install the hook, or patch in place if torchtitan's utils are already imported."""
    utils = sys.modules.get(TARGET_MODULE)
    if utils is None:
        register()
    else:
        _patch(utils)
