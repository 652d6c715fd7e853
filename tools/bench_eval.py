"""Benchmark: what validation costs a run, and `eval`'s throughput against training's (CPU).

    uv run python -m tools.bench_eval [--repeats 3] [--steps 30]

Prints (issue 16's targets):
  - the wall time of `train` with the embedded default (the `debug` config: validation at steps 1, 10,
    20 and 30, 3 batches each) against the same command with `--validator.no-enable`, run alternately;
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
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from qwen3_titan_common.perf.precision import describe_cpu

from tools.bench_dense_common import ROOT, TRAIN, cpu_env

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

BACKEND = "native-backend"


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


_STAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def validation_seconds(log: str) -> float:
    """Seconds the run spent validating, from its own log: each validation line's time stamp less the one
    of the line before it (its step line, or the end of that step's checkpoint). Measured inside one run,
    this share does not depend on how two separate runs were slowed by other load."""
    stamped = [(line, _STAMP.search(line)) for line in log.splitlines()]
    stamped = [(line, datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")) for line, m in stamped if m]
    return sum(
        (when - stamped[i - 1][1]).total_seconds()
        for i, (line, when) in enumerate(stamped)
        if i and "validation  step:" in _ANSI.sub("", line)
    )


def train_run(steps: int, extra: list[str]) -> tuple[float, float, float, float]:
    """(wall s, CPU s, training tokens/s, validation s) of `train` (the default config and outputs), from
    start to exit. The CPU time of its process tree is steadier than the wall time on a machine others
    share. Tokens/s: the median of the step lines after the first quarter (warm-up)."""
    from qwen3_titan_common.perf.train_log import parse_step_lines

    with tempfile.TemporaryDirectory() as tmp:
        cpu = _children_cpu_seconds()
        start = time.perf_counter()
        proc = subprocess.run(
            [TRAIN, "--training.steps", str(steps), "--dump_folder", tmp, *extra],
            env=cpu_env(BACKEND), capture_output=True, text=True, cwd=tmp,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        cpu = _children_cpu_seconds() - cpu
    if proc.returncode != 0:
        raise RuntimeError(f"train failed\n{proc.stderr[-3000:]}")
    log = proc.stdout + proc.stderr
    lines = parse_step_lines(log)
    tps = statistics.median(s.tokens_per_second for s in lines[len(lines) // 4 :])
    return seconds, cpu, tps, validation_seconds(log)


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
    from qwen3_titan_common.data.validation import ValidationDataLoader
    from qwen3_titan_common.hf.eval_models import eval_model, native_qwen3
    from qwen3_titan_common.scripts.eval import DTYPES, evaluate
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(default_tokenizer_dir()))
    data = ValidationDataLoader.Config(dataset="default", split="train", records="held_out")
    model = eval_model(
        native_qwen3, default_architecture(), None, dtype=DTYPES[dtype_name], seq_len=256, seed=0
    )

    def loader():
        return data.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=256, local_batch_size=8)

    evaluate(model, loader(), torch.device("cpu"), "warm-up", max_batches=2)
    return evaluate(model, loader(), torch.device("cpu"), "timed").tokens_per_second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="training steps (the debug config's: 30)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are
    r, n = args.repeats, args.steps
    with_validation, without, eval_fp32, eval_bf16 = [], [], [], []
    for _ in range(r):  # alternately, so that a change in the machine's load hits all alike
        with_validation.append(train_run(n, []))
        without.append(train_run(n, ["--validator.no-enable"]))
        eval_fp32.append(eval_tokens_per_second("float32"))
        eval_bf16.append(eval_tokens_per_second("bfloat16"))

    def spread(values: list[float]) -> tuple[float, float, float]:
        return statistics.median(values), min(values), max(values)

    figures = {
        "train_wall_s_with_validation": spread([run[0] for run in with_validation]),
        "train_wall_s_without_validation": spread([run[0] for run in without]),
        "train_cpu_s_with_validation": spread([run[1] for run in with_validation]),
        "train_cpu_s_without_validation": spread([run[1] for run in without]),
        "validation_s_in_run": spread([run[3] for run in with_validation]),
        "train_tps": spread([run[2] for run in without]),
        "eval_fp32_tps": spread(eval_fp32),
        "eval_bf16_tps": spread(eval_bf16),
    }
    print(
        f"CPU ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}), debug model, medians of {r} runs (min-max):"
    )
    for name, (median, low, high) in figures.items():
        print(f"  {name:<34} {median:>10,.1f}  ({low:,.1f}-{high:,.1f})")
    for which, name in ((0, "wall time"), (1, "CPU time")):
        paired = statistics.median(
            w[which] / o[which] - 1 for w, o in zip(with_validation, without, strict=True)
        )
        print(
            f"validation overhead on the embedded default's {name}: {100 * paired:.1f}% "
            f"(median of paired runs; target <= 10%): {'met' if paired <= 0.10 else 'MISSED'}"
        )
    in_run = statistics.median(run[3] / (run[0] - run[3]) for run in with_validation)
    print(
        f"validation overhead measured inside each run (its validation lines' time over the rest of its wall "
        f"time; median): {100 * in_run:.1f}% (target <= 10%): {'met' if in_run <= 0.10 else 'MISSED'}"
    )
    for name, runs in (("eval_fp32_tps", eval_fp32), ("eval_bf16_tps", eval_bf16)):
        ratio = statistics.median(e / run[2] for e, run in zip(runs, without, strict=True))
        print(
            f"{name}: {ratio:.2f}x training's tokens/s (median of paired runs; target >= 2x): "
            f"{'met' if ratio >= 2 else 'MISSED'}"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
