"""Published-style weights in, training, a directory transformers loads out."""

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.hf.titan_load import build_titan_qwen3
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_common.train.tolerance import ModelBounds
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from transformers import AutoModelForCausalLM

TRAIN = str(Path(sys.executable).with_name("train"))
CPU_ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
# fp32 compute end to end, so losses compare at fp32 precision.
EXACT = ["--training.mixed_precision_param", "float32", "--debug.seed", "0", "--debug.deterministic"]


def _train(*args, cwd):
    proc = subprocess.run([TRAIN, *args], cwd=cwd, env=CPU_ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _logits_over_bound(path: Path) -> float:
    """max |torchtitan's logits - transformers'| on 2 x 40 tokens, over the derived bound of that difference."""
    model_dir = open_model_dir(path)
    titan = build_titan_qwen3(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(
        0, model_dir.architecture.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        diff = (titan(tokens) - reference(tokens).logits).abs().max().item()
    return diff / ModelBounds.from_dir(path).logit_atol(seq_len=tokens.shape[1])


@pytest.fixture(scope="module")
def trained_export(tmp_path_factory):
    """20 steps from a tiny checkpoint (tied or not), exported: (source, the run's log, the export), each kind
    trained once for every test that reads it."""

    @functools.cache
    def run(tied: bool) -> tuple[Path, str, Path]:
        tmp = tmp_path_factory.mktemp("tied" if tied else "untied")
        source = make_tiny_checkpoint(tmp / "source", tied=tied, max_shard_size="60KB")
        log = _train(
            "--hf-model", str(source), "--training.steps", "20", "--training.seq_len", "128",
            "--hf.max_shard_size", "100KB", "--dump_folder", str(tmp / "out"), *EXACT, cwd=tmp,
        )  # fmt: skip
        return source, log, tmp / "out" / "hf" / "step-20"

    return run


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_train_20_steps_from_checkpoint_then_transformers_loads_the_export(trained_export, tied):
    source, log, export = trained_export(tied)
    assert f"[start] loading Hugging Face weights from {source}" in log
    assert len(parse_step_lines(log)) == 20
    assert (export / "model.safetensors.index.json").is_file() and (export / "tokenizer.json").is_file()
    config = json.loads((export / "config.json").read_text())
    source_config = json.loads((source / "config.json").read_text())
    changed = {k for k in config.keys() | source_config.keys() if config.get(k) != source_config.get(k)}
    assert changed <= {"dtype", "torch_dtype"}
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    weight_map = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in weight_map) == (not tied)
    # Training moved the weights, and both implementations read the same new ones.
    assert not torch.equal(
        model.model.norm.weight, AutoModelForCausalLM.from_pretrained(source).model.norm.weight
    )
    assert _logits_over_bound(export) <= 1.0


def _first_batch_loss(export: Path, tmp_path: Path) -> float:
    """transformers' loss on the first batch the debug config's dataloader produces, each document scored alone
    as training scores it (per-document positions, no attention mask, no cache: transformers' packed rows)."""
    from qwen3_titan_native.config_registry import debug

    config = debug()
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=config.training.seq_len,
        local_batch_size=config.training.local_batch_size,
    )  # fmt: skip
    inputs, labels = next(iter(loader))
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs["input"], position_ids=inputs["positions"], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()


@pytest.mark.slow
def test_loss_continues_across_export_and_reload(trained_export, tmp_path):
    """The recipe's check: a trained model, exported and reloaded, starts where it ended."""
    source, first, export = trained_export(True)
    # The tiny checkpoint's weights are transformers' random initialisation: the first loss is about ln(vocab).
    random_start = parse_step_lines(first)[0].loss
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    second = _train(
        "--hf-model", str(export), "--training.steps", "1", "--dump_folder", str(tmp_path / "b"), *EXACT,
        cwd=tmp_path,
    )  # fmt: skip
    reloaded_first_step = parse_step_lines(second)[0].loss
    reference = _first_batch_loss(export, tmp_path)
    print(f"first-step loss: random init {random_start:.2f}, reloaded {reloaded_first_step:.2f} "
          f"(ln(vocab) = {math.log(vocab):.2f}); exported model on that batch: {reference:.4f}")  # fmt: skip
    assert abs(random_start - math.log(vocab)) < 0.5
    # Trained weights, not a restart (20 steps of 1,024 tokens lower the loss by about 1.6); the exact check:
    assert reloaded_first_step < random_start - 1.0
    # The step line's loss (5 decimals) and transformers' on one batch of the debug shape: the derived bound.
    bound = ModelBounds.from_dir(export).loss_atol(reference, tokens=8 * 256, seq_len=256)
    assert abs(reloaded_first_step - reference) <= bound + 0.5e-5
