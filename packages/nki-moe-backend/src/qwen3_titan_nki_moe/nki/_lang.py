"""The NKI language the kernels are written against, imported in one place.

Written for nki 0.7.0, the NKI of Neuron SDK 2.33.0 (the NKI migration table's pairing; SDK
2.33 is the release with torch-neuronx 2.14 for PyTorch 2.14). What that version decides here:

- kernels are specialized by tracing them as Python, so helper functions and closures are
  ordinary Python; ``nl.affine_range``/``sequential_range``/``static_range`` are deprecated
  and mean Python's ``range`` (fully unrolled), so the kernels use ``range`` for the short
  static loops and ``nl.fori_loop`` for the loops whose trip count grows with the data;
- a ``fori_loop`` body receives its index as an ``NkiScalar``; ``nisa.scalar_load`` reads one
  from a ``(1, 1)`` int32 SBUF tile; either serves as an access pattern's ``scalar_offset``.

Only the ``nki`` package is needed (no ``torch_neuronx``): ``tools/run_neuron_tests.py
--simulate`` runs these kernels under ``nki.simulate`` on a machine without Trainium.
"""

from __future__ import annotations

from qwen3_titan_nki_moe.nki import missing_neuron_package

try:
    import nki
    import nki.isa as nisa
    import nki.language as nl
except ImportError as err:  # CPU/CUDA hosts, or PyPI's placeholder package
    raise missing_neuron_package("qwen3_titan_nki_moe's NKI kernels need the nki package", err) from err

from qwen3_titan_nki_moe.kernel_limits import MOVING_MAX, PARTITIONS

# Partitions of an SBUF/PSUM tile: every kernel tiles rows (or a contraction) by it.
P = PARTITIONS

__all__ = ["MOVING_MAX", "P", "nisa", "nki", "nl"]
