"""A broken --hf-model directory stops the launcher before any rank starts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint


@pytest.fixture
def single(tmp_path):
    return make_tiny_checkpoint(tmp_path / "single")


@pytest.mark.parametrize("breakage", ["no_config", "truncated"])
def test_launcher_fails_in_one_line_and_writes_nothing(tmp_path, single, breakage):
    if breakage == "no_config":
        (single / "config.json").unlink()
    else:
        weights = single / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    dump = tmp_path / "out"
    train = str(Path(sys.executable).with_name("train"))
    proc = subprocess.run(
        [train, "--hf-model", str(single), "--dump_folder", str(dump)],
        capture_output=True, text=True, env={**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train: ") and str(single) in last
    assert not dump.exists()
