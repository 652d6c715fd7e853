"""Run at start-up by every Python process whose PYTHONPATH holds this folder (the driver puts it first).

Three things, none of which imports torch or torchtitan here:

1. an import hook that runs ``gpu_bench_shims.apply()`` right before ``torchtitan`` is first imported,
   so every process (every rank, were torchrun used) gets the polyfills before torchtitan looks;
2. common's torchtitan device hook (``qwen3_titan_common.runtime.device_autoload.register``), which an
   installed ``common`` gets from its ``torch.backends`` entry point: with the packages only on PYTHONPATH
   it would be missing, and torchtitan would then take a CPU host for CUDA (on a GPU it changes nothing);
3. the ``sitecustomize`` this file shadows (e.g. Debian's), if there is one, still runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _ShimsBeforeTorchtitan(importlib.abc.MetaPathFinder):
    # Stays on sys.meta_path (removing itself mid-lookup would make the import skip a finder).
    done = False

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchtitan" or self.done:
            return None
        self.done = True
        import gpu_bench_shims  # beside this file, so on sys.path already: this file was found there

        gpu_bench_shims.apply()
        return None  # the regular finders import torchtitan itself


def _run_shadowed_sitecustomize() -> None:
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == _HERE:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):  # by path: importing by name would find this file again
            spec = importlib.util.spec_from_file_location("_gpu_bench_shadowed_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                try:
                    spec.loader.exec_module(importlib.util.module_from_spec(spec))
                except Exception as err:  # another file's failure must not stop this process
                    print(f"[gpu-bench compat] {candidate} failed: {err!r}", file=sys.stderr)
            return


if "torchtitan" not in sys.modules and os.environ.get("GPU_BENCH_NO_SHIMS") != "1":
    sys.meta_path.insert(0, _ShimsBeforeTorchtitan())
try:
    from qwen3_titan_common.runtime.device_autoload import register as _register_device_hook
except ImportError:  # common not on the path: nothing of ours will import torchtitan
    pass
else:
    _register_device_hook()
_run_shadowed_sitecustomize()
