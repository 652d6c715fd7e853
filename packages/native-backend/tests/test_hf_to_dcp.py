"""``train --hf.to_dcp``: Hugging Face weights converted to a torchtitan checkpoint without training, by the
trainer's own loading and DCP writing; a run on the same folder starts from it as from the directory itself."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.hf.titan_load import build_titan_qwen3
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_native import BACKEND
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.trained import load_trained_model

TRAIN = str(Path(sys.executable).with_name("train"))
EXACT = ["--training.mixed_precision_param", "float32", "--debug.seed", "0", "--debug.deterministic"]


def _train(*args, cwd: Path) -> str:
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    proc = subprocess.run(
        [TRAIN, *map(str, args)], env=env, capture_output=True, text=True, timeout=600, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_converted_weights_are_the_directorys_and_a_run_starts_from_them(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "model")
    out = tmp_path / "converted"
    log = _train("--hf-model", model, "--hf.to_dcp", "--out", out, cwd=tmp_path)
    step_zero = out / "checkpoint" / "step-0"
    assert (step_zero / ".metadata").is_file()
    assert not (out / "hf").exists() and "step: 1" not in log  # nothing trained, nothing exported
    assert "converted:" in log and "--checkpoint.initial_load_path" in log
    # The checkpoint read back as a run's ranks build the model: every tensor the directory's, bit for bit.
    args = ["--module", BACKEND.module, "--config", "debug", "--hf.model_dir", str(model)]
    loaded = load_trained_model(args, step_zero).state_dict()
    expected = build_titan_qwen3(open_model_dir(model)).state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    # A run on that folder starts from step-0's weights: its first loss is that of a run from the directory.
    common = ["--hf-model", model, "--steps", "2", "--hf.no-export", "--validator.no-enable", *EXACT]
    resumed = _train(*common, "--out", out, cwd=tmp_path)
    assert "step-0" in resumed
    direct = _train(*common, "--out", tmp_path / "direct", cwd=tmp_path)
    first = [parse_step_lines(text)[0].loss for text in (resumed, direct)]
    assert first[0] == first[1]
