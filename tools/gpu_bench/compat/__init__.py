"""The torch polyfills, put first on the benchmark children's PYTHONPATH (its ``sitecustomize`` applies them).

A package too, so that a process started without this folder on its path (a test, a bare ``tt_run``)
reaches the same ``gpu_bench_shims.py`` as ``tools.gpu_bench.compat.gpu_bench_shims``.
"""

from __future__ import annotations


def shims():
    """The shims module as this process has it: the one sitecustomize imported and applied (top-level
    ``gpu_bench_shims``, this folder being on PYTHONPATH), so that what it patched is reported; else this
    package's copy of the same file."""
    try:
        import gpu_bench_shims
    except ImportError:
        from tools.gpu_bench.compat import gpu_bench_shims
    return gpu_bench_shims
