"""On a CUDA GPU: every backend trains like it does on the CPU, and a real-size export loads in transformers.

Each backend starts from one checkpoint written by transformers' ``save_pretrained`` (the embedded
default's architecture; nki-moe's ``debug_moe`` for the MoE backend), so the CPU and the GPU run begin
from the same weights whatever their random generators do, and trains a few steps in fp32 on the
embedded corpus with the same seed and flags on both devices. The launcher runs as ``python -m
qwen3_titan_common.launcher.launch --module <backend>`` (the form that needs no installed console script, as on
a machine where the packages are only on ``PYTHONPATH``). Skipped where no CUDA device is present; ``python3 -m tools.gpu_bench.device_check``
runs them on the lent GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3_titan_common.assets import default_model_dir, default_tokenizer_dir
from qwen3_titan_common.perf.train_log import parse_step_lines

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

STEPS = 3
FP32 = ["--training.mixed_precision_param", "float32", "--debug.seed", "0"]
BACKENDS = {
    "native-backend": ("qwen3_titan_native", "debug"),
    "hf-v5-backend": ("qwen3_titan_hf_v5", "debug"),
    "nki-moe-backend": ("qwen3_titan_nki_moe", "debug_moe"),
}


def _start(module: str, *args: str, cwd: Path, device: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "QWEN3_TITAN_DEVICE"}
    if device is not None:
        env["QWEN3_TITAN_DEVICE"] = device
    command = [sys.executable, "-m", "qwen3_titan_common.launcher.launch", "--module", module, *args]
    return subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen, device: str | None, timeout: int = 600) -> str:
    log, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(proc.args)} on {device or 'the default device'}:\n{log[-4000:]}"
    return log


def _launch(module: str, *args: str, cwd: Path, device: str | None, timeout: int = 600) -> str:
    return _finish(_start(module, *args, cwd=cwd, device=device), device, timeout)


def _config_of(module: str, config: str) -> dict:
    """The config.json the backend's config function trains (its architecture's source)."""
    if config == "debug":
        return json.loads((default_model_dir() / "config.json").read_text())
    from qwen3_titan_common.assets import DEBUG_MOE_CONFIG

    return dict(DEBUG_MOE_CONFIG)


def _save_checkpoint(config_json: dict, path: Path, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    fields = dict(config_json)
    model_type = fields.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), dtype=torch.float32)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(default_tokenizer_dir())).save_pretrained(path)
    return path


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_cuda_training_matches_cpu(tmp_path, backend):
    module, config = BACKENDS[backend]
    source = _save_checkpoint(_config_of(module, config), tmp_path / "source")
    runs = {
        device: _start(
            module,
            "--config",
            config,
            "--hf-model",
            str(source),
            "--training.steps",
            str(STEPS),
            "--hf.no-export",
            "--checkpoint.no-enable",
            "--dump_folder",
            str(tmp_path / device),
            *FP32,
            cwd=tmp_path,
            device=device,
        )  # fmt: skip
        for device in ("cpu", "cuda")  # side by side: they share nothing but the checkpoint they read
    }
    losses = {}
    for device, proc in runs.items():
        log = _finish(proc, device)
        assert f"device: {device} x" in log
        losses[device] = [s.loss for s in parse_step_lines(log)]
        assert len(losses[device]) == STEPS, f"{device}: {len(losses[device])} step lines"
    print(f"{backend}: cpu {losses['cpu']}\n{' ' * len(backend)}  cuda {losses['cuda']}")
    assert all(math.isfinite(x) for x in losses["cuda"])
    for cpu, cuda in zip(losses["cpu"], losses["cuda"], strict=True):
        assert abs(cpu - cuda) <= 1e-4 * abs(cpu), (backend, losses)


def test_hf_v5_flex_attention_trains_on_cuda_like_sdpa(tmp_path):
    source = _save_checkpoint(_config_of("qwen3_titan_hf_v5", "debug"), tmp_path / "source")
    losses = {}
    for attention in ("sdpa", "flex"):
        log = _launch(
            "qwen3_titan_hf_v5", "--hf-model", str(source), "--hf_v5.attention", attention,
            "--training.steps", str(STEPS), "--hf.no-export", "--checkpoint.no-enable",
            "--dump_folder", str(tmp_path / attention), *FP32, cwd=tmp_path, device=None,
        )  # fmt: skip
        assert "device: cuda" in log
        losses[attention] = [s.loss for s in parse_step_lines(log)]
    assert len(losses["flex"]) == STEPS
    assert all(abs(a - b) <= 1e-3 * abs(a) for a, b in zip(losses["sdpa"], losses["flex"], strict=True)), (
        losses
    )


def test_qwen3_1_7b_shape_trains_two_steps_and_its_export_loads_in_transformers_on_cuda(tmp_path):
    log = _launch(
        "qwen3_titan_native", "--config", "qwen3_1_7b", "--training.steps", "2", "--training.seq_len", "1024",
        "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--checkpoint.no-enable",
        "--hf.export_dtype", "bfloat16",
        "--dump_folder", str(tmp_path / "out"), cwd=tmp_path, device=None, timeout=900,
    )  # fmt: skip
    steps = parse_step_lines(log)
    assert [s.step for s in steps] == [1, 2] and all(math.isfinite(s.loss) for s in steps)
    export = tmp_path / "out" / "hf" / "step-2"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.hidden_size == 2048 and model.config.num_hidden_layers == 28
    assert model.lm_head.weight is model.model.embed_tokens.weight  # Qwen3-1.7B ties them
    model = model.to("cuda").eval()
    ids = AutoTokenizer.from_pretrained(export).encode("def sorted(iterable, key=None, reverse=False):")
    tokens = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        logits = model(tokens).logits.float()
    assert torch.isfinite(logits).all()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:]).item()
    # Two steps from random initialisation: still about ln(151,936) = 11.93.
    assert abs(loss - math.log(model.config.vocab_size)) < 1.5, loss
