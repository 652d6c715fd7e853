"""Benchmark: what validation costs a run, and `eval`'s throughput against training's (CPU).

    uv run python -m tools.bench_eval [--repeats 3] [--steps 30]

Prints (issue 16's targets):
  - the wall time of `train` with the embedded default (the `debug` config: validation at steps 1, 10,
    20 and 30, 4 batches each) against the same command with `--validator.no-enable`, run alternately;
    target: validation adds at most 10%;
  - `eval`'s tokens/s (forward only, the `debug` model, batch 8 x seq 256 over the embedded corpus's
    held-out part, fp32 and bf16) against the training tokens/s of the same model and shape (the step
    lines of `train`, bf16 mixed precision as the config trains); target: at least 2x.
Medians over repeats, with the range. Runs are sequential on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench_dense_common import ROOT, TRAIN, cpu_env, trainer_tokens_per_second

BACKEND = "native-backend"


def train_wall_seconds(steps: int, extra: list[str]) -> float:
    """Seconds from starting `train` (the default config and outputs) until it exits."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run(
            [TRAIN, "--training.steps", str(steps), "--dump_folder", tmp, *extra],
            env=cpu_env(BACKEND), capture_output=True, text=True, cwd=tmp,
        )  # fmt: skip
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"train failed\n{proc.stderr[-3000:]}")
    return seconds


def eval_tokens_per_second(dtype_name: str) -> float:
    """`eval`'s forward loop on the debug model (random init: the weights do not change the work)."""
    code = (
        "import json; from tools import bench_eval as b; "
        f"print(json.dumps(b.eval_tokens_per_second_here({dtype_name!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def eval_tokens_per_second_here(dtype_name: str) -> float:
    import torch
    from qwen3_titan_common.assets import default_architecture, default_tokenizer_dir
    from qwen3_titan_common.cli.eval import DTYPES, evaluate
    from qwen3_titan_common.data.validation import ValidationDataLoader
    from qwen3_titan_common.hf.eval_models import native_qwen3
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(default_tokenizer_dir()))
    data = ValidationDataLoader.Config(dataset="default", split="train", records="held_out")
    model = native_qwen3(default_architecture(), None, dtype=DTYPES[dtype_name], seq_len=256, seed=0)

    def loader():
        return data.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=256, local_batch_size=8)

    evaluate(model, loader(), torch.device("cpu"), "warm-up", max_batches=2)
    return evaluate(model, loader(), torch.device("cpu"), "timed").tokens_per_second


def _measure(fn, repeats: int) -> tuple[float, float, float]:
    values = sorted(fn() for _ in range(repeats))
    return statistics.median(values), values[0], values[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="training steps (the debug config's: 30)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    r, n = args.repeats, args.steps
    with_validation, without = [], []
    for _ in range(r):  # alternately, so that a change in the machine's load hits both alike
        with_validation.append(train_wall_seconds(n, []))
        without.append(train_wall_seconds(n, ["--validator.no-enable"]))
    figures = {
        "train_wall_s_with_validation": (
            statistics.median(with_validation),
            min(with_validation),
            max(with_validation),
        ),
        "train_wall_s_without_validation": (statistics.median(without), min(without), max(without)),
        "train_tps": _measure(lambda: trainer_tokens_per_second(BACKEND, n, []), r),
        "eval_fp32_tps": _measure(lambda: eval_tokens_per_second("float32"), r),
        "eval_bf16_tps": _measure(lambda: eval_tokens_per_second("bfloat16"), r),
    }
    print(
        f"CPU ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}), debug model, medians of {r} runs (min-max):"
    )
    for name, (median, low, high) in figures.items():
        print(f"  {name:<34} {median:>10,.1f}  ({low:,.1f}-{high:,.1f})")
    paired = statistics.median(w / o - 1 for w, o in zip(with_validation, without, strict=True))
    print(
        f"validation overhead on the embedded default's wall time: {100 * paired:.1f}% "
        f"(median of paired runs; target <= 10%): {'met' if paired <= 0.10 else 'MISSED'}"
    )
    train_tps = figures["train_tps"][0]
    for name in ("eval_fp32_tps", "eval_bf16_tps"):
        ratio = figures[name][0] / train_tps
        print(f"{name}: {ratio:.2f}x training's tokens/s (target >= 2x): {'met' if ratio >= 2 else 'MISSED'}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
