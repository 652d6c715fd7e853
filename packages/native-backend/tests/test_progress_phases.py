"""Every phase of a run that can last long prints its progress: loading the weights, the first step,
each checkpoint save, each validation and the export (``--metrics.progress_seconds 0``: from the start).

A real-size run reaches the default 5 s in each of them (issue 39: a Qwen3-0.6B-shaped run on a CPU spends
78 s in its first step, 28 s saving and 42 s validating); this tiny run shows that each one is covered.
"""

import os
import subprocess
import sys
from pathlib import Path

from qwen3_titan_testing.checkpoints import make_tiny_checkpoint

TRAIN = str(Path(sys.executable).with_name("train"))
PHASES = (
    "loading the checkpoint before step 1: done in",
    "step 1, the first of this run (compilation, warm-up): done in",
    "validation at step 1: done in",
    "checkpoint of step 2 (",
    "validation at step 2: done in",
    "export to ",
)


def test_each_phase_prints_progress(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model")
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    proc = subprocess.run(
        [TRAIN, "--hf-model", str(model), "--steps", "2", "--checkpoint.interval", "2", "--validator.freq", "2",
         "--metrics.progress_seconds", "0", "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    progress = [line.split("[progress] ", 1)[1] for line in log.splitlines() if "[progress] " in line]
    for phase in PHASES:
        assert any(line.startswith(phase) for line in progress), f"no progress line for {phase!r}: {progress}"
    # Each phase says when it ended, in the order the run went through them.
    ends = [
        next(i for i, line in enumerate(progress) if line.startswith(p) and "done in" in line) for p in PHASES
    ]
    assert ends == sorted(ends), progress
