"""The import check's child: imports every module of the named top-level packages.

    <package env>/bin/python -I tools/ci/import_probe.py qwen3_titan_native [...]

Run by path inside a package's own environment with ``-I`` (no current folder, no script folder on
``sys.path``), so only what is installed there can be imported; standard library only, and nothing of
``tools`` is imported. A module that raises ImportError itself (not ModuleNotFoundError) says it is
unavailable on this platform, e.g. NKI kernels that need the Neuron SDK: listed, not failed. Anything
else fails. The last line counts them; the exit status is 1 when any failed.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys


def main(tops: list[str]) -> int:
    counts = {"imported": 0, "unavailable": 0, "failed": 0}

    def attempt(name: str):
        try:
            module = importlib.import_module(name)
        except Exception as err:
            if type(err) is ImportError:
                counts["unavailable"] += 1
                print(f"import check: {name}: unavailable here: {err}", flush=True)
            else:
                counts["failed"] += 1
                print(f"import check FAILED: {name}: {type(err).__name__}: {err}", flush=True)
            return None
        counts["imported"] += 1
        return module

    for top in tops:
        module = attempt(top)
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), top + ".", onerror=lambda n: None):
            attempt(info.name)
    print(
        f"import check: {counts['imported']} modules imported, {counts['unavailable']} unavailable here, "
        f"{counts['failed']} failed",
        flush=True,
    )
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
