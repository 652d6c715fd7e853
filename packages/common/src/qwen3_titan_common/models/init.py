"""Random initialisation shared by every backend's Qwen3, so their models start alike."""

from __future__ import annotations

INIT_STD = 0.02


def residual_init_std(num_layers: int) -> float:
    """Std of the projections that write into the residual stream (scaled down with depth)."""
    return INIT_STD / (2 * num_layers) ** 0.5
