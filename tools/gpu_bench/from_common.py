"""The standard-library-only parts of ``common`` that the driver uses (it never imports torch).

Imported here, once, so that a driver started without ``common`` importable (on the GPU machine our
packages are only sources: ``PYTHONPATH=packages/common/src``) stops with one line saying so.
"""

from __future__ import annotations

try:
    from qwen3_titan_common.arch.published import published_architecture
    from qwen3_titan_common.perf.flops import flops_breakdown
    from qwen3_titan_common.perf.peaks import peak_flops
    from qwen3_titan_common.perf.train_log import parse_step_lines
except ModuleNotFoundError as err:
    if not (err.name or "").startswith("qwen3_titan_common"):
        raise
    raise SystemExit(
        f"gpu-bench: {err.name} is not importable: run from the repository root with "
        "PYTHONPATH=packages/common/src (tools/gpu_bench/README.md), or in the workspace's environment"
    ) from None

__all__ = ["flops_breakdown", "parse_step_lines", "peak_flops", "published_architecture"]
