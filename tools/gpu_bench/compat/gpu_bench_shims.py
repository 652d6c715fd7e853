"""Polyfills that let torchtitan 0.3.0 (written against torch 2.14) run on an older torch.

The GPU image has torch 2.11, which lacks two names torchtitan 0.3.0 uses:

``torch.distributed.set_timeout``
    called after step 1 (``torchtitan.distributed.utils``, "Synchronizing and adjusting
    timeout"); older torch has the same operation as ``distributed_c10d._set_pg_timeout``.
``torch.distributed.fsdp.DataParallelMeshDims``
    imported by ``torchtitan.distributed.fsdp`` at import time; only the ``full_dtensor`` SPMD
    backend builds one, which a one-GPU run does not use, so a dataclass with torch 2.14's fields
    is enough. Passing it to ``fully_shard(dp_mesh_dims=...)`` is not supported by the stub.

:func:`apply` patches a name only when it is missing, so it changes nothing on a torch that has
both, and prints one ``[gpu-bench compat]`` line per process saying what it did; the driver reads
those lines back into its report. ``GPU_BENCH_NO_SHIMS=1`` turns every shim off.
"""

from __future__ import annotations

import dataclasses
import os
import sys

PREFIX = "[gpu-bench compat]"
APPLIED: list[str] = []
_state = {"done": False}


def missing() -> list[str]:
    """The shimmed names this torch lacks (imports torch.distributed, patches nothing)."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    names = []
    if not hasattr(dist, "set_timeout"):
        names.append("torch.distributed.set_timeout")
    if not hasattr(fsdp, "DataParallelMeshDims"):
        names.append("torch.distributed.fsdp.DataParallelMeshDims")
    return names


def _set_timeout_polyfill(dist):
    legacy = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if legacy is None:
        raise RuntimeError("torch.distributed has neither set_timeout nor distributed_c10d._set_pg_timeout")

    def set_timeout(timeout, group=None) -> None:
        legacy(timeout, group)

    return set_timeout


@dataclasses.dataclass
class DataParallelMeshDims:
    """Stand-in for torch 2.14's ``torch.distributed.fsdp.DataParallelMeshDims`` (same fields)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @staticmethod
    def _names(value) -> tuple[str, ...]:
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else tuple(value)

    @property
    def shard_names(self) -> tuple[str, ...]:
        return self._names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return self._names(self.replicate)


def apply(quiet: bool = False) -> list[str]:
    """Patch what is missing (once per process); returns the names patched."""
    if _state["done"]:
        return APPLIED
    _state["done"] = True
    import torch

    if os.environ.get("GPU_BENCH_NO_SHIMS") == "1":
        if not quiet:
            print(
                f"{PREFIX} torch {torch.__version__}: shims disabled (GPU_BENCH_NO_SHIMS=1)", file=sys.stderr
            )
        return APPLIED
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout_polyfill(dist)
        APPLIED.append("torch.distributed.set_timeout")
    if not hasattr(fsdp, "DataParallelMeshDims"):
        DataParallelMeshDims.__module__ = "torch.distributed.fsdp"
        fsdp.DataParallelMeshDims = DataParallelMeshDims
        APPLIED.append("torch.distributed.fsdp.DataParallelMeshDims")
    if not quiet:
        what = "applied " + ", ".join(APPLIED) if APPLIED else "no shim needed"
        print(f"{PREFIX} torch {torch.__version__}: {what}", file=sys.stderr, flush=True)
    return APPLIED
