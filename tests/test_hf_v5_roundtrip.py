"""hf-v5 export -> native load -> export -> hf-v5 load -> export: the same fp32 bits throughout.

Each load-and-export is one training step at learning rate 0 (`--training.steps` must be
positive), which moves no weight: AdamW's update and weight decay are both scaled by the rate.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.hf.titan_load import read_hf_state_dict
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint

TRAIN = str(Path(sys.executable).with_name("train"))
FP32 = ["--training.mixed_precision_param", "float32", "--hf.export_dtype", "float32"]
NO_UPDATE = ["--training.steps", "1", "--optimizer.param_groups.0.optimizer_kwargs.lr", "0"]


def _export(backend: str, source: Path, out: Path, *args: str) -> Path:
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": backend}
    command = [
        TRAIN,
        "--hf-model",
        str(source),
        "--training.seq_len",
        "128",
        "--dump_folder",
        str(out),
        *FP32,
        *args,
    ]
    proc = subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (export,) = (out / "hf").iterdir()
    return export


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return read_hf_state_dict(open_model_dir(path))


def _assert_bit_identical(a: Path, b: Path) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys(), sorted(ta.keys() ^ tb.keys())[:8]
    different = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:4]}"
    config_a, config_b = (json.loads((p / "config.json").read_text()) for p in (a, b))
    assert config_a["tie_word_embeddings"] == config_b["tie_word_embeddings"]


@pytest.mark.slow
# Untied: the MoE model (its lm_head and its experts); the dense MLP with the tied pair.
@pytest.mark.parametrize(("moe", "tied"), [(False, True), (True, False)], ids=["tied", "moe"])
def test_hf_v5_native_hf_v5_round_trip_is_bit_identical(tmp_path, moe, tied):
    source = make_tiny_checkpoint(tmp_path / "source", moe=moe, tied=tied)
    # A trained hf-v5 export, not the initial checkpoint, starts the round trip.
    trained = _export("hf-v5-backend", source, tmp_path / "train", "--training.steps", "3")
    through_native = _export("native-backend", trained, tmp_path / "native", *NO_UPDATE)
    _assert_bit_identical(trained, through_native)
    back = _export("hf-v5-backend", through_native, tmp_path / "back", *NO_UPDATE)
    _assert_bit_identical(trained, back)
    assert ("lm_head.weight" in _tensors(back)) == (not tied)
