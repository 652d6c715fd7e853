"""Run the nki-moe backend's NKI kernel checks: under NKI's CPU simulator, or on a trn2 host.

    uv run python tools/run_neuron_tests.py --simulate    # any Linux machine with the Neuron nki package
    uv run python tools/run_neuron_tests.py               # a trn2 host: every kernel on the device
    uv run python tools/run_neuron_tests.py -k rope       # extra arguments go to pytest

``--simulate`` is the first check, before any Trainium time: the Neuron package repository's
``nki`` package (0.3.0 and later; 0.7.0 in Neuron SDK 2.33) ships a CPU simulator,
``nki.simulate(kernel[grid])(*arrays)``, that runs a kernel with NumPy and checks the hardware
rules it models (tile shapes, dtypes, buffers); no ``torch-neuronx`` and no device needed. It
runs the ``nki_simulator``-marked tests (``packages/nki-moe-backend/tests/test_nki_kernels_cpu.py``:
each kernel's own source against the reference ops), with ``NEURON_PLATFORM_TARGET_OVERRIDE=trn2``
unless exported (the simulator assumes trn3 where no chip is found). PyTorch code that calls
``@nki.jit`` kernels can also run on the simulator unchanged with ``NKI_SIMULATOR=1``; our
kernels' PyTorch side needs torch-neuronx, so the tests use the explicit API. Install:
``uv pip install --index-url <Neuron repository URL> nki`` (PyPI's ``nki`` is a placeholder).

Without ``--simulate`` it runs the ``neuron``-marked tests (``tests/test_nki_neuron.py``) on a
trn2 host: torch-neuronx, neuronx-cc and nki from the Neuron package repository (README: "On a
Trainium host"), the Neuron environment from ``qwen3_titan_common.runtime.neuron_env`` (LNC=2
unless exported). First runs compile each kernel (minutes); later runs hit the cache.

Each stops with one line when what it needs is missing (the tests themselves only skip).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "packages" / "nki-moe-backend" / "tests"
NAME = "run_neuron_tests"


def nki_simulator_problem() -> str | None:
    """Why ``nki.simulate`` cannot run here, in one line; None when it can."""
    try:
        import nki
    except ImportError as err:  # absent, or PyPI's placeholder ("WRONG PACKAGE ...")
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (
            "nki is not installed (the NKI simulator, nki.simulate, ships in the Neuron package repository's nki "
            "package; PyPI's nki is a placeholder): uv pip install --index-url <Neuron repository URL> nki"
            f" [{first}]"
        )
    if not hasattr(nki, "simulate"):
        version = getattr(nki, "__version__", "unknown")
        return f"nki {version} has no nki.simulate: the simulator needs nki 0.3.0 or later (Neuron SDK 2.29+)"
    return None


def simulate(argv: list[str]) -> int:
    problem = nki_simulator_problem()
    if problem is not None:
        print(f"{NAME} --simulate: {problem}", file=sys.stderr)
        return 2
    env = {**os.environ}
    env.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    command = [sys.executable, "-m", "pytest", str(SUITE), "-m", "nki_simulator", "-rA", *argv]
    print(
        f"[{NAME}] NEURON_PLATFORM_TARGET_OVERRIDE={env['NEURON_PLATFORM_TARGET_OVERRIDE']} "
        + " ".join(command),
        flush=True,
    )
    return subprocess.call(command, cwd=ROOT, env=env)


def on_trainium(argv: list[str]) -> int:
    from qwen3_titan_common.runtime.device import neuron_available
    from qwen3_titan_common.runtime.neuron_env import neuron_env_updates

    if not neuron_available():
        print(
            f"{NAME}: no usable Neuron device (torch_neuronx from the Neuron repository must import and "
            "torch.neuron.is_available() must be true); run this on a trn2 host, or use --simulate",
            file=sys.stderr,
        )
        return 2
    env = {**os.environ, **neuron_env_updates()}
    env.pop("QWEN3_TITAN_DEVICE", None)  # a forced CPU device would skip everything
    command = [sys.executable, "-m", "pytest", str(SUITE), "-m", "neuron", "-rA", *argv]
    print(f"[{NAME}] " + " ".join(command), flush=True)
    return subprocess.call(command, cwd=ROOT, env=env)


def main(argv: list[str]) -> int:
    if "--simulate" in argv:
        return simulate([a for a in argv if a != "--simulate"])
    return on_trainium(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
