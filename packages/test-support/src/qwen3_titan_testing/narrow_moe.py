"""The narrow-data MoE experiment's pieces (``tools/moe_balance_narrow.py``, ``docs/moe.md``): a Qwen3-MoE
of 8 experts, top 2, written by transformers' ``save_pretrained`` with seed 0; one chat record to repeat; a
``train`` run of it with or without the router balance loss; the experts' load that run wrote to
TensorBoard, and every scalar of a run's TensorBoard file (what the multi-rank tests compare).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TRAIN = str(Path(sys.executable).with_name("train"))
RECORD = {
    "messages": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ]
}


def make_checkpoint(path: Path) -> Path:
    import torch
    from qwen3_titan_common.assets import default_tokenizer_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=1024, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_tokenizer_dir()).save_pretrained(path)
    return path


def tensorboard_scalars(tb_dir: Path) -> dict[str, list[float]]:
    """Every scalar a run wrote to TensorBoard (``<dump_folder>/tb``), by tag, in step order, at full precision."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(tb_dir.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    return {tag: [s.value for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def last_loads(tb_dir: Path) -> dict[str, dict[str, float]]:
    loads: dict[str, dict[str, float]] = {}
    for tag, values in tensorboard_scalars(tb_dir).items():
        if tag.startswith("moe/layer_"):
            layer, what = tag[len("moe/layer_") :].split("/")
            loads.setdefault(layer, {})[what] = values[-1]
        elif tag in ("loss_metrics/global_avg_loss", "loss_metrics/router_aux_loss"):
            loads.setdefault("run", {})[tag.split("/")[1]] = values[-1]
    return loads


def run(model: Path, data: Path, out: Path, steps: int, coef: float | None) -> dict:
    args = [
        TRAIN, "--hf-model", str(model), "--dataloader.dataset", str(data), "--training.steps", str(steps),
        "--training.seq_len", "128", "--training.local_batch_size", "4", "--metrics.log_freq", "10",
        "--training.mixed_precision_param", "float32", "--checkpoint.no-enable", "--hf.no-export",
        "--validator.no-enable", "--debug.seed", "0", "--dump_folder", str(out),
    ]  # fmt: skip
    if coef is not None:
        args += ["--moe.router_aux_loss", "on", "--moe.router_aux_loss_coef", str(coef)]
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"train failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return last_loads(out / "tb")
