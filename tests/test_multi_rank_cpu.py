"""Tensor parallelism from a model of another vocabulary than the config function's, through the real launcher.

Every layout of every backend against one rank: tests/test_parallel_layouts.py.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRAIN = str(Path(sys.executable).with_name("train"))


@pytest.mark.slow
def test_tensor_parallel_from_a_model_of_another_vocabulary_equals_one_rank(tmp_path):
    """torchtitan's vocabulary-parallel cross-entropy splits the logits by the loss config's vocabulary: it must
    be the --hf-model's (8,192 here), not the config function's (4,096)."""
    from qwen3_titan_common.train.tolerance import ModelBounds
    from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
    from qwen3_titan_testing.narrow_moe import tensorboard_scalars

    model = make_tiny_checkpoint(tmp_path / "model", vocab_size=8192)
    env = {
        **os.environ,
        "QWEN3_TITAN_DEVICE": "cpu",
        "QWEN3_TITAN_BACKEND": "native-backend",
        "OMP_NUM_THREADS": "1",
    }
    losses = {}
    for ranks, parallel in ((1, []), (2, ["--parallelism.tensor_parallel_degree", "2"])):
        out = tmp_path / f"ranks-{ranks}"
        command = [
            TRAIN, "--hf-model", str(model), "--nproc_per_node", str(ranks), *parallel, "--training.steps", "2",
            "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32", "--training.seq_len", "128",
            "--checkpoint.no-enable", "--hf.no-export", "--validator.no-enable", "--debug.seed", "0",
            "--dump_folder", str(out),
        ]  # fmt: skip
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        losses[ranks] = tensorboard_scalars(out / "tb")["loss_metrics/global_avg_loss"]
    # Step k's loss: a mean over 1,024 tokens of fp32 cross-entropies over 8,192 logits, reduced in another order
    # when the vocabulary and the projections are split (then all-reduced): the derived bound of 2k - 1 passes.
    bounds = ModelBounds.from_dir(model)
    assert len(losses[1]) == len(losses[2]) == 2
    for step, (one, two) in enumerate(zip(losses[1], losses[2], strict=True), start=1):
        bound = bounds.loss_atol(one, tokens=1024, seq_len=128, passes=2 * step - 1)
        assert abs(one - two) <= bound, (step, losses, bound)
