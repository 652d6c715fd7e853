"""Installs the torchtitan device shim through PyTorch's backend autoload.

``common`` registers :func:`register` under the ``torch.backends`` entry-point group,
so ``import torch`` calls it in every process of this environment, including ranks
started by the upstream form ``torchrun ... -m torchtitan.train``. It only adds an
import hook (no torchtitan import, no device query), so the cost for programs that
never import torchtitan is one list insert. The hook runs the real device detection
after ``torchtitan.tools.utils`` executes and before any module copies its globals.
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` disables all autoloading, this included; the
``train`` launchers then install the hook themselves (:func:`ensure_installed`).
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
        from qwen3_titan_common.device import patch_torchtitan_utils

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
        from qwen3_titan_common.device import patch_torchtitan_utils

        patch_torchtitan_utils(utils)
        return
    register()
