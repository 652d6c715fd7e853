"""Peak dense BF16 throughput per rank, the denominator of MFU.

NVIDIA GPUs (and anything else torchtitan knows): torchtitan's own table,
``torchtitan.tools.utils.get_peak_flops``, which torchtitan's metrics already use. Trainium is not in
it; this table adds it:

| device | TFLOP/s | source |
|---|---|---|
| AWS Trainium2, per logical core at LNC=2 | 158 | 2 NeuronCore-v3 x 79 (Neuron docs, NeuronCore-v3) |
| AWS Trainium2, per chip | 667 | Neuron docs, Trainium2 architecture |
| AWS Trainium3, per logical core at LNC=2 | 167.75 | 671 per chip / 4 (Neuron docs, Trainium3) |
| AWS Trainium1, per NeuronCore-v2 | 95 | 190 per chip / 2 (Neuron docs, Trainium) |
| CPU | none | no meaningful peak: MFU is not reported |

A torchtitan rank on Trainium is one logical NeuronCore, so MFU uses the per-logical-core
figure; multiply by 4 (LNC=2) for the chip, whose published figure (667) is slightly
above 8 x 79.
"""

from __future__ import annotations

TFLOPS = 1e12

NEURON_PEAK_BF16_FLOPS: dict[str, float] = {
    "trn2 logical core (lnc=2)": 158 * TFLOPS,
    "trn2 chip": 667 * TFLOPS,
    "trn3 logical core (lnc=2)": 167.75 * TFLOPS,
    "trn1 core": 95 * TFLOPS,
}
_NEURONCORE_V3 = 79 * TFLOPS
_TRN3_CORE = 671 / 8 * TFLOPS


def neuron_peak_flops(device_name: str, logical_core_size: int = 2) -> tuple[float, str]:
    """(peak FLOP/s of one torchtitan rank, the table row) on a Trainium device."""
    name = device_name.lower()
    if name.startswith("trn1"):
        return NEURON_PEAK_BF16_FLOPS["trn1 core"], "trn1 core"
    generation = "trn3" if name.startswith("trn3") else "trn2"
    per_core = _TRN3_CORE if generation == "trn3" else _NEURONCORE_V3
    return per_core * logical_core_size, f"{generation} logical core (lnc={logical_core_size})"


def peak_flops(
    device_kind: str, device_name: str, titan_peak: float | None = None
) -> tuple[float | None, str]:
    """(peak FLOP/s per rank, where it comes from) for a device; (None, reason) where MFU is meaningless.

    ``titan_peak`` is torchtitan's figure for the device (``get_peak_flops``), used for every device
    but Trainium and the CPU.
    """
    if device_kind == "cpu":
        return None, "cpu: no peak, MFU not reported"
    if device_kind == "neuron":
        return neuron_peak_flops(device_name)
    if titan_peak is None:
        return None, f"{device_name}: no peak given"
    return titan_peak, f"torchtitan's table for {device_name}"
