"""Every backend trains with several CPU ranks (gloo), through the real launcher.

FSDP2 issues its gradient reduce-scatter as ReduceOp.PREMUL_SUM, which gloo lacks; the shared
trainer switches it to a plain sum on gloo (qwen3_titan_common.runtime.fsdp_comms). One rank never
reduces, so only a multi-rank run catches a path that misses the switch.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.perf.train_log import parse_step_lines

TRAIN = str(Path(sys.executable).with_name("train"))
STEPS = 6


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native-backend", "hf-v5-backend", "nki-moe-backend"])
def test_two_cpu_ranks_train(tmp_path, backend):
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": backend, "OMP_NUM_THREADS": "1"}
    command = [
        TRAIN, "--nproc_per_node", "2", "--training.steps", str(STEPS), "--checkpoint.no-enable",
        "--debug.seed", "0", "--dump_folder", str(tmp_path / "out"),
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "dp_shard=2" in log, log[-4000:]  # torchtitan's mesh line: two ranks share the model
    losses = [s.loss for s in parse_step_lines(log)]
    assert len(losses) == STEPS, log[-4000:]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0], losses
