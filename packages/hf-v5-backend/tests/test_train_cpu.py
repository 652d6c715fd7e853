"""hf-v5-backend trains end to end through the real launcher and Trainer, and its exports load."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3_titan_common.assets import DEBUG_MOE_CONFIG, default_architecture
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.hf.titan_load import read_hf_state_dict
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

TRAIN = str(Path(sys.executable).with_name("train"))
VERIFY = str(Path(sys.executable).with_name("verify-checkpoint"))
ENV = {**os.environ, "QWEN3_TITAN_BACKEND": "hf-v5-backend"}
CPU_ENV = {**ENV, "QWEN3_TITAN_DEVICE": "cpu"}
# Loads and exports without moving a weight: one step at learning rate 0, fp32 throughout.
NO_UPDATE = [
    "--training.steps", "1", "--optimizer.param_groups.0.optimizer_kwargs.lr", "0",
    "--training.mixed_precision_param", "float32",
]  # fmt: skip


def _train(*args, cwd, env=CPU_ENV):
    proc = subprocess.run([TRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _loads_completely(export: Path):
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model


def _verified(export: Path) -> None:
    """common's verify-checkpoint: keys complete, transformers and torchtitan's Qwen3 give the same logits."""
    proc = subprocess.run([VERIFY, str(export)], env=CPU_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return read_hf_state_dict(open_model_dir(path))


@pytest.mark.slow
def test_default_config_trains_logs_and_exports_a_loadable_model(tmp_path):
    log = _train("--dump_folder", str(tmp_path / "out"), cwd=tmp_path)
    assert "device: cpu x1" in log and "--module qwen3_titan_hf_v5 --config debug" in log
    steps = parse_step_lines(log)
    assert [s.step for s in steps] == list(range(1, 31))
    # Random init predicts the vocabulary nearly uniformly: the first loss is about ln(vocab), as the HF round
    # trip's test bounds it.
    assert abs(steps[0].loss - math.log(default_architecture().vocab_size)) < 0.5
    assert steps[-1].loss < steps[0].loss - 1.5
    assert all(s.tokens_per_second > 0 and s.memory_gib > 0 for s in steps)
    export = tmp_path / "out" / "hf" / "step-30"
    model = _loads_completely(export)
    assert "lm_head.weight" not in _tensors(export)  # tied, as the embedded config.json says
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert json.loads((export / "config.json").read_text())["tie_word_embeddings"] is True
    _verified(export)


@pytest.mark.slow
def test_tiny_moe_trains_and_round_trips_its_per_expert_keys(tmp_path):
    log = _train(
        "--config", "debug_moe", "--training.steps", "4", "--dump_folder", str(tmp_path / "a"), cwd=tmp_path
    )
    steps = parse_step_lines(log)
    assert len(steps) == 4 and steps[-1].loss < steps[0].loss
    export = tmp_path / "a" / "hf" / "step-4"
    tensors = _tensors(export)
    last_layer, last_expert = DEBUG_MOE_CONFIG["num_hidden_layers"] - 1, DEBUG_MOE_CONFIG["num_experts"] - 1
    assert f"model.layers.{last_layer}.mlp.experts.{last_expert}.down_proj.weight" in tensors
    assert not any(key.endswith(("gate_up_proj", "experts.down_proj")) for key in tensors)
    _loads_completely(export)
    _verified(export)
    _train("--hf-model", str(export), *NO_UPDATE, "--dump_folder", str(tmp_path / "b"), cwd=tmp_path)
    again = _tensors(tmp_path / "b" / "hf" / "step-1")
    assert tensors.keys() == again.keys()
    assert all(torch.equal(tensors[k], again[k]) for k in tensors)


@pytest.mark.slow
def test_untied_on_purpose_exports_its_trained_lm_head(tmp_path):
    source = make_tiny_checkpoint(tmp_path / "tied", tied=True)
    log = _train(
        "--hf-model", str(source), "--hf_v5.untie_embeddings", "--training.steps", "3",
        "--training.seq_len", "128", "--dump_folder", str(tmp_path / "out"), cwd=tmp_path,
    )  # fmt: skip
    assert "lm_head.weight starts as a copy of model.embed_tokens.weight" in log
    export = tmp_path / "out" / "hf" / "step-3"
    assert json.loads((export / "config.json").read_text())["tie_word_embeddings"] is False
    tensors = _tensors(export)
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    model = _loads_completely(export)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    _verified(export)
