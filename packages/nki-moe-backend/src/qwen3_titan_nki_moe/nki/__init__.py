"""NKI kernels for the registry's ops, and their PyTorch registrations. Trainium only.

Nothing here is imported on a CPU or CUDA host: ``qwen3_titan_nki_moe.registry`` imports a
module of this package only after ``qwen3_titan_common.runtime.device`` found a Neuron device (and
``torch_neuronx`` and ``nki`` imported). Each module holds

- the kernel(s), written against ``nki.jit`` / ``nki.language`` / ``nki.isa`` (nki 0.3,
  Neuron SDK 2.33 API: ``dst=`` arguments, ``nl.ndarray(..., buffer=...)``);
- ``torch_neuronx.nki_op`` custom ops (namespace ``qwen3_titan_nki``) that launch them with
  ``wrap_nki(kernel)[LNC]``, and ``register_autograd`` tying the forward op to its backward op;
- the function the registry hands out, which falls back to the reference op for tensors not
  on a Neuron device or shapes the kernel does not take.

UNTESTED ON HARDWARE: written from the NKI and torch-neuronx documentation; no Trainium host
and no NKI simulator (proprietary ``nki`` wheel) were available. ``tools/run_neuron_tests.py``
runs their checks against the reference ops on a trn2 host.
"""
