"""A long row trained with context parallelism, through the real ``train`` command on the CPU: rows of 16,384
tokens (a tiny Qwen3 whose ``config.json`` allows them) on 2 CP ranks, resumed on one rank, resumed again on 2,
and exported as a Hugging Face checkpoint that transformers loads and computes with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint

TRAIN = str(Path(sys.executable).with_name("train"))
SEQ_LEN = 16384


def _train(model: Path, out: Path, nproc: int, steps: int, *flags: str) -> str:
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    command = [
        TRAIN, "--hf-model", str(model), "--nproc", str(nproc), "--steps", str(steps), "--seq-len", str(SEQ_LEN),
        "--batch-size", "1", "--training.mixed_precision_param", "float32", "--validator.no-enable",
        "--metrics.log_freq", "1", "--checkpoint.interval", "1", "--out", str(out), *flags,
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.mark.slow
def test_a_long_row_trains_on_two_cp_ranks_resumes_on_one_and_back_and_exports(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model", config_changes={"max_position_embeddings": SEQ_LEN})
    out = tmp_path / "run"
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    logs = [_train(model, out, 2, 1, *cp2, "--hf.no-export")]
    assert f"each row of {SEQ_LEN} tokens in 4 chunks of 4096" in logs[0]
    logs.append(_train(model, out, 1, 2, "--hf.no-export"))
    assert "resuming from step 1" in logs[1]
    logs.append(_train(model, out, 2, 3, *cp2))
    assert "resuming from step 2" in logs[2]
    trained = [(line.step, line.loss) for log in logs for line in parse_step_lines(log)]
    assert [step for step, _ in trained] == [1, 2, 3], trained
    assert all(0 < loss < 20 for _, loss in trained), trained
    # The export is the model transformers builds from its config.json, the long positions kept.
    from transformers import AutoModelForCausalLM

    export = out / "hf" / "step-3"
    assert json.loads((export / "config.json").read_text())["max_position_embeddings"] == SEQ_LEN
    loaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = loaded(torch.randint(1, 4096, (1, 64))).logits
    assert logits.shape == (1, 64, 4096) and torch.isfinite(logits).all()
