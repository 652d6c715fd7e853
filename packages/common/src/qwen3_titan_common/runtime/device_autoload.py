"""Installs the torchtitan device shim before torchtitan detects its device.

``common`` installs a ``qwen3_titan_device_hook.pth`` file that calls :func:`register`
at interpreter start, in every process of the environment, including ranks started
by the upstream form ``torchrun ... -m torchtitan.train``; the same function is also a
``torch.backends`` entry point (PyTorch's device-backend autoload) for installs that
skip ``.pth`` files. It only adds an import hook (no torch or torchtitan import, no
device query), so programs that never import torchtitan pay one list insert. The
hook runs the real device detection right after ``torchtitan.tools.utils`` executes
and before any other torchtitan module copies its ``device_type``/``device_module``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET_MODULE = "torchtitan.tools.utils"


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def create_module(self, spec):
        return self._wrapped.create_module(spec)

    def exec_module(self, module) -> None:
        self._wrapped.exec_module(module)
        from qwen3_titan_common.runtime.device import patch_torchtitan_utils

        patch_torchtitan_utils(module)


class _TorchtitanDeviceHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchAfterExec(spec.loader)
                return spec
        return None


def _installed() -> bool:
    return any(isinstance(f, _TorchtitanDeviceHook) for f in sys.meta_path)


def register() -> None:
    """The ``torch.backends`` entry point."""
    if not _installed():
        sys.meta_path.insert(0, _TorchtitanDeviceHook())


def ensure_installed() -> None:
    """Install the hook, or patch in place if torchtitan's utils are already imported."""
    utils = sys.modules.get(TARGET_MODULE)
    if utils is not None:
        from qwen3_titan_common.runtime.device import patch_torchtitan_utils

        patch_torchtitan_utils(utils)
        return
    register()
