"""A Trainium host whose environment has lost the Neuron SDK, said in the device line.

The SDK (torch-neuronx, neuronx-cc, nki) comes from the Neuron package repository, outside the lock: a plain
``uv sync`` makes the environment exactly the lock and removes it, while ``uv run`` and ``uv sync --inexact``
keep it (README: "On a Trainium host"). Without it the run would silently fall back to the CPU.
"""

from __future__ import annotations

import glob
import importlib.util
from dataclasses import dataclass

NEURON_DEVICES = "/dev/neuron[0-9]*"


@dataclass(frozen=True)
class NeuronSdkPins:
    """The Neuron SDK release this project targets, as its support matrix lists it for torchtitan
    (https://awsdocs-neuron.readthedocs-hosted.com, release notes of SDK 2.33: TorchNeuron beta).

    The lock's torch is ``torch`` (root pyproject.toml's ``constraint-dependencies``), the one torch-neuronx
    ``torch_neuronx`` is built against, so installing the SDK leaves the locked torch where it is;
    tests/test_neuron_sdk_env.py reads the lock against this table.
    """

    release: str
    torch: str
    torch_neuronx: str


NEURON_SDK = NeuronSdkPins(release="2.33", torch="2.14.0", torch_neuronx="2.14.3")
INSTALL = f"uv pip install --index neuron torch-neuronx=={NEURON_SDK.torch_neuronx}.* neuronx-cc nki"


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
