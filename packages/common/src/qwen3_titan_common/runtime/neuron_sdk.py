"""A Trainium host whose environment has lost the Neuron SDK, said in the device line.

The SDK (torch-neuronx, neuronx-cc, nki) comes from the Neuron package repository, outside the lock: a plain
``uv sync`` makes the environment exactly the lock and removes it, while ``uv run`` and ``uv sync --inexact``
keep it (README: "On a Trainium host"). Without it the run would silently fall back to the CPU.
"""

from __future__ import annotations

import glob
import importlib.util

NEURON_DEVICES = "/dev/neuron[0-9]*"
INSTALL = "uv pip install --index neuron torch-neuronx==2.14.* neuronx-cc nki"


def missing_sdk_note(devices: str = NEURON_DEVICES) -> str | None:
    """Why a host with Neuron devices runs without them, or None (no devices, or the SDK is there)."""
    found = sorted(glob.glob(devices))
    if not found:
        return None
    if importlib.util.find_spec("torch_neuronx") is not None:
        return None
    return (
        f"Neuron devices are present ({found[0]}) but this environment has no Neuron SDK: `{INSTALL}` "
        "installs it (a plain `uv sync` removes it again; `uv run` and `uv sync --inexact` keep it)"
    )
