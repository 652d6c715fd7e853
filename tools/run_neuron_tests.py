"""Run the nki-moe backend's Trainium test suite (the ``neuron``-marked tests) on a trn2 host.

    uv run python tools/run_neuron_tests.py            # every NKI kernel against its reference op
    uv run python tools/run_neuron_tests.py -k rope    # extra arguments go to pytest

Needs torch-neuronx, neuronx-cc and nki from the Neuron package repository in this environment
(README: "On a Trainium host"; PyPI only has placeholders). The Neuron environment comes from
``qwen3_titan_common.runtime.neuron_env`` (LNC=2 unless exported). Off Trainium it stops with the reason:
the same tests only skip there. First runs compile each kernel (minutes); later runs hit the cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "packages" / "nki-moe-backend" / "tests"


def main(argv: list[str]) -> int:
    from qwen3_titan_common.runtime.device import neuron_available
    from qwen3_titan_common.runtime.neuron_env import neuron_env_updates

    if not neuron_available():
        print(
            "run_neuron_tests: no usable Neuron device (torch_neuronx from the Neuron repository must import and "
            "torch.neuron.is_available() must be true); run this on a trn2 host",
            file=sys.stderr,
        )
        return 2
    env = {**os.environ, **neuron_env_updates()}
    env.pop("QWEN3_TITAN_DEVICE", None)  # a forced CPU device would skip everything
    command = [sys.executable, "-m", "pytest", str(SUITE), "-m", "neuron", "-rA", *argv]
    print("[run_neuron_tests] " + " ".join(command), flush=True)
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
