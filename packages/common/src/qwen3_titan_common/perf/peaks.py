"""Peak dense BF16 throughput per device, the denominator of MFU.

| device | TFLOP/s | source |
|---|---|---|
| NVIDIA H100 SXM / H200 | 989 | NVIDIA datasheets (dense, without sparsity) |
| NVIDIA H100 PCIe | 756 | NVIDIA datasheet |
| NVIDIA H100 NVL | 835 | NVIDIA datasheet |
| NVIDIA A100 | 312 | NVIDIA datasheet |
| NVIDIA B200 | 2250 | NVIDIA datasheet (dense) |
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

PEAK_BF16_FLOPS: dict[str, float] = {
    "h200": 989 * TFLOPS,
    "h100 sxm": 989 * TFLOPS,
    "h100 pcie": 756 * TFLOPS,
    "h100 nvl": 835 * TFLOPS,
    "h100": 989 * TFLOPS,
    "a100": 312 * TFLOPS,
    "b200": 2250 * TFLOPS,
    "trn2 logical core (lnc=2)": 158 * TFLOPS,
    "trn2 chip": 667 * TFLOPS,
    "trn3 logical core (lnc=2)": 167.75 * TFLOPS,
    "trn1 core": 95 * TFLOPS,
}


def peak_flops(device_kind: str, device_name: str, logical_core_size: int = 2) -> tuple[float | None, str]:
    """(peak FLOP/s per rank, table row) for a device; (None, reason) where MFU is meaningless."""
    name = device_name.lower()
    if device_kind == "cpu":
        return None, "cpu: no peak, MFU not reported"
    if device_kind == "neuron":
        if name.startswith("trn1"):
            return PEAK_BF16_FLOPS["trn1 core"], "trn1 core"
        per_core = 79 * TFLOPS if not name.startswith("trn3") else 671 / 8 * TFLOPS
        row = f"{'trn3' if name.startswith('trn3') else 'trn2'} logical core (lnc={logical_core_size})"
        return per_core * logical_core_size, row
    for key in ("h200", "h100 nvl", "h100 pcie", "h100", "a100", "b200"):
        if all(part in name for part in key.split()):
            return PEAK_BF16_FLOPS[key], key
    return None, f"{device_name}: not in the peak table, MFU not reported"
