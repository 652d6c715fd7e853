"""Preference training on the transformers backend: step 1 at ln 2, packed with the prompt shared (the block-sparse
attention) and one pair per row with LoRA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.preference import EXACT, LORA, assert_starts_at_ln2, dpo_flags

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "hf-v5-backend"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "layout"),
    [([], "prompt computed once per pair"), (["--dataloader.no-packing", *LORA], "one pair per row")],
    ids=["packed", "unpacked-lora"],
)
def test_dpo_starts_at_ln2(tmp_path, flags, layout):
    source = make_tiny_checkpoint(tmp_path / "source")
    args = [
        *dpo_flags(tmp_path),
        "--hf-model",
        str(source),
        *EXACT,
        *flags,
        "--steps",
        "2",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run([TRAIN, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert_starts_at_ln2(log, source)
    assert layout in log
