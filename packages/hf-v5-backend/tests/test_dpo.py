"""Preference training on the transformers backend: step 1 at ln 2, packed with the prompt shared (the block-sparse
attention) and one pair per row with LoRA (peft's adapters) and the reference live: the adapters' starting values
swapped in score each step, so step 2, after the adapters moved, is off ln 2."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.preference import EXACT, LORA, assert_starts_at_ln2, dpo_flags, ln2_bound

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "hf-v5-backend"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "layout"),
    [
        ([], "prompt computed once per pair"),
        # A learning rate at which step 1 moves the adapters' step-2 loss well past the bound of ln 2.
        (["--dataloader.no-packing", *LORA, "--dpo.reference", "live", "--lr", "0.1"], "one pair per row"),
    ],
    ids=["packed", "unpacked-lora-live"],
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
        "2" if flags else "1",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run([TRAIN, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert_starts_at_ln2(log, source)
    assert layout in log
    if not flags:
        # The 61 training pairs fill 2 batches of 8 rows: one step reads half what the pass before step 1
        # scored, which is said, with the way out.
        assert (
            "[dpo] training reads 1 of the 2 batches scored (50%; 1 step to go); --dpo.reference live" in log
        )
    if "live" in flags:
        assert (
            "[dpo] reference: live, the starting values of 28 trained tensors" in log
        )  # 2 layers x 7 x A, B
        # A reference that followed the adapters would keep every step at ln 2.
        assert abs(parse_step_lines(log)[1].loss - math.log(2)) > ln2_bound(source), log[-2000:]
