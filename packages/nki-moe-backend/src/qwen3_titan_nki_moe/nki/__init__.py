"""NKI kernels for the registry's ops, and their PyTorch registrations. Trainium only.

Nothing here is imported on a CPU or CUDA host: ``qwen3_titan_nki_moe.registry`` imports a
module of this package only after ``qwen3_titan_common.runtime.device`` found a Neuron device (and
``torch_neuronx`` and ``nki`` imported). Per op, two modules:

- ``<op>_kernel``: the kernel(s), ``@nki.jit`` against ``nki.language`` / ``nki.isa`` (nki 0.7.0,
  the NKI of Neuron SDK 2.33.0: ``dst=`` arguments, ``nl.ndarray(..., buffer=...)``,
  ``nl.fori_loop`` for run-time loops); each docstring states the kernel's limits with the SBUF
  arithmetic behind them (``qwen3_titan_nki_moe.kernel_limits``). These import only ``nki``;
- ``<op>``: the ``torch_neuronx.nki_op`` custom ops (namespace ``qwen3_titan_nki``) that launch
  the kernels on a ``(LNC,)`` grid, each wrapped once (``qwen3_titan_nki_moe.kernel_launch``),
  ``register_autograd`` tying the forward op to its backward op, and the function the registry
  hands out, which falls back to the reference op for tensors not on a Neuron device or shapes
  the kernels do not take.

UNTESTED ON HARDWARE: written from the NKI and torch-neuronx documentation; no Trainium host and
no Neuron ``nki`` package were available. The kernels' own source runs on CPU in the tests,
against a twin of the NKI API (``tests/fake_nki_twin_no_trainium.py``: the documented semantics
of every instruction they use, checks of tile limits, measured SBUF footprints and instruction
counts). On a machine with the Neuron repository's ``nki`` package, ``python
tools/run_neuron_tests.py --simulate`` runs the same tests under the real ``nki.simulate``; on a
trn2 host ``python tools/run_neuron_tests.py`` runs each op against its reference on the device.
"""


def missing_neuron_package(needs: str, err: ImportError) -> ImportError:
    """The one-line error for a Neuron-repository package that is absent (or PyPI's placeholder)."""
    return ImportError(f"{needs} from the Neuron package repository (PyPI only has placeholders): {err}")
