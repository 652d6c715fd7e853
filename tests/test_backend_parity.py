"""The native and hf-v5 backends train the same model to the same losses.

Both start from one tiny checkpoint (written by transformers' save_pretrained) through the real
`train --hf-model DIR`, on the CPU in fp32 with the same data, seed and optimizer: torchtitan's
native Qwen3 and transformers' Qwen3ForCausalLM must then agree step by step.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint

TRAIN = str(Path(sys.executable).with_name("train"))
EXACT = ["--training.mixed_precision_param", "float32", "--debug.seed", "0", "--debug.deterministic"]
TOKENS, SEQ_LEN = 8 * 256, 256  # a step of the debug shape
PRINTED_LOSS = 0.5e-5  # a step line's loss has 5 decimals


def _step_bound(loss: float, source: Path, step: int) -> float:
    """Step ``step``'s loss of two fp32 implementations of one model: the derived bound, both sides printed."""
    bound = ModelBounds.from_dir(source).loss_atol(loss, tokens=TOKENS, seq_len=SEQ_LEN, passes=2 * step - 1)
    return bound + 2 * PRINTED_LOSS


def _losses(backend: str, source: Path, steps: int, out: Path) -> list[float]:
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": backend}
    command = [
        TRAIN, "--hf-model", str(source), "--training.steps", str(steps), "--hf.no-export",
        "--dump_folder", str(out), *EXACT,
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [s.loss for s in parse_step_lines(proc.stdout + proc.stderr)]
    assert len(losses) == steps, f"{backend}: {len(losses)} step lines"
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_same_checkpoint_same_losses_on_both_backends(tmp_path, tied):
    source = make_tiny_checkpoint(tmp_path / "source", tied=tied)
    native = _losses("native-backend", source, 5, tmp_path / "native")
    hf_v5 = _losses("hf-v5-backend", source, 5, tmp_path / "hf_v5")
    print(f"native {native}\nhf-v5  {hf_v5}")
    for step, (a, b) in enumerate(zip(native, hf_v5, strict=True), start=1):
        assert abs(a - b) <= _step_bound(a, source, step), (step, native, hf_v5)


@pytest.mark.slow
def test_same_moe_checkpoint_same_first_step_loss(tmp_path):
    # Only the first step: afterwards the native MoE's auxiliary-loss-free balancing moves its
    # expert biases (and so its routing), which transformers' Qwen3-MoE does not have.
    source = make_tiny_checkpoint(tmp_path / "source", moe=True, tied=False)
    native = _losses("native-backend", source, 1, tmp_path / "native")
    hf_v5 = _losses("hf-v5-backend", source, 1, tmp_path / "hf_v5")
    assert abs(native[0] - hf_v5[0]) <= _step_bound(native[0], source, 1)
