"""How the NKI kernels are launched from PyTorch: the grid, and one wrapped callable per kernel.

Two facts about ``torch_neuronx.wrap_nki`` decide this module (read in two versions of
torch-neuronx's source of ``wrap_nki`` and the ``NKIHOPCaller`` it returns):

- the grid: one version's ``NKIHOPCaller.__getitem__`` turns an int into ``(int,)``, the other
  runs ``tuple(map(int, grid))``, so ``wrap_nki(kernel)[2]`` raises ``TypeError: 'int' object
  is not iterable`` there, while a tuple works in both. Our kernels split their work over the ``LNC`` physical cores
  of a logical NeuronCore, so the grid is ``(lnc,)``; NKI 0.7 (Neuron SDK 2.33) checks that
  this matches the compiler's LNC (``NEURON_LOGICAL_NC_CONFIG``).
- the cost of wrapping: every ``wrap_nki(kernel)`` call traces the kernel again and adds it to
  torch-neuronx's kernel table (in the version read, the table looks the kernel up by a key it
  never stores, so the lookup always misses).
  Wrapping on every call would re-trace and re-register on every step, so each
  ``(kernel, lnc)`` is wrapped once, here, and the callable is reused.

Nothing here imports the Neuron SDK: the wrapper is passed in (``torch_neuronx.wrap_nki`` on
a Neuron host, the CPU twin in the tests), which is what makes the grid and the caching
testable on any machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def launch_grid(lnc: int) -> tuple[int]:
    """The SPMD launch grid of a kernel split over a logical core's ``lnc`` physical cores."""
    lnc = int(lnc)
    if lnc < 1:
        raise ValueError(f"logical core size {lnc}: expected 1 or more (NEURON_LOGICAL_NC_CONFIG)")
    return (lnc,)


class KernelLaunchers:
    """``wrap(kernel)[launch_grid(lnc)]``, built on first use per ``(kernel, lnc)`` and kept.

    Keyed by the kernel object's identity (module-level ``@nki.jit`` kernels live as long as
    the process; the cache holds a reference, so an id is never reused while cached).
    """

    def __init__(self, wrap: Callable[[Any], Any]):
        self._wrap = wrap
        self._launchers: dict[tuple[int, int], tuple[Any, Any]] = {}

    def __call__(self, kernel: Any, lnc: int) -> Any:
        key = (id(kernel), int(lnc))
        cached = self._launchers.get(key)
        if cached is None:
            cached = (kernel, self._wrap(kernel)[launch_grid(lnc)])
            self._launchers[key] = cached
        return cached[1]

    def __len__(self) -> int:
        return len(self._launchers)
