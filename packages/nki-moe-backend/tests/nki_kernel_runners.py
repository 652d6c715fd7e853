"""Two ways to run the NKI kernels' source on CPU, behind one interface (used by the kernel tests).

``fake_nki_twin_no_trainium``  always: the tests' CPU twin of the NKI API (no Trainium here, no
                               Neuron ``nki`` package); measures allocations and instructions.
``nki_simulator``              where the Neuron repository's ``nki`` package is installed:
                               ``nki.simulate(kernel[grid])`` on numpy arrays (fp32 only here:
                               numpy has no bfloat16 without ml_dtypes).
"""

from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager

import fake_nki_twin_no_trainium as twin
import pytest
import torch
from qwen3_titan_nki_moe.kernel_launch import launch_grid

TWIN = "fake_nki_twin_no_trainium"
SIMULATOR = "nki_simulator"


class TwinRunner:
    name = TWIN

    def __init__(self):
        self._modules: dict = {}

    def module(self, name: str):
        if name not in self._modules:
            self._modules[name] = twin.import_kernel_module(name)
        return self._modules[name]

    def run(self, kernel, lnc: int, *args):
        return kernel[launch_grid(lnc)](*args)

    @staticmethod
    def measure() -> twin.Measure:
        return twin.STATE.launches[-1]


class SimulatorRunner:
    name = SIMULATOR

    def __init__(self, nki):
        self.nki = nki
        self._modules: dict = {}

    def module(self, name: str):
        if name not in self._modules:
            self._modules[name] = importlib.import_module(f"qwen3_titan_nki_moe.nki.{name}")
        return self._modules[name]

    def run(self, kernel, lnc: int, *args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dtype not in (torch.float32, torch.int32):
                pytest.skip(f"nki_simulator runner takes fp32/int32 numpy inputs, not {a.dtype}")
        arrays = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
        out = self.nki.simulate(kernel[launch_grid(lnc)])(*arrays)
        if isinstance(out, tuple | list):
            return tuple(torch.from_numpy(o.copy()) for o in out)
        return torch.from_numpy(out.copy())

    @staticmethod
    def measure():
        return None


@contextmanager
def runner(name: str):
    if name == TWIN:
        with twin.installed(with_torch_neuronx=False):
            yield TwinRunner()
        return
    nki = pytest.importorskip("nki", reason="the Neuron repository's nki package is not installed")
    if not hasattr(nki, "simulate"):
        pytest.skip("this nki has no nki.simulate (needs nki >= 0.3.0, Neuron SDK 2.29+)")
    saved = {m: sys.modules[m] for m in list(sys.modules) if m.startswith("qwen3_titan_nki_moe.nki")}
    target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    # The simulator defaults to trn3 where no chip is found; the kernels' limits are trn2's.
    os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    try:
        yield SimulatorRunner(nki)
    finally:
        for m in [m for m in sys.modules if m.startswith("qwen3_titan_nki_moe.nki")]:
            del sys.modules[m]
        sys.modules.update(saved)
        if target is None:
            os.environ.pop("NEURON_PLATFORM_TARGET_OVERRIDE", None)
