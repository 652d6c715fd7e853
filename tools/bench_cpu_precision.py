"""Benchmark: the README's first command at its default precision against the same run in fp32, on this CPU
and on this CPU without its bf16 instructions (CPU).

    uv run python -m tools.bench_cpu_precision [--pairs 3] [--old-default-steps 3]

A CPU without bf16 matrix instructions is emulated with ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN, which runs
torch's bf16 GEMM, then uses none of them, and torch falls back to its reference loop, as on an AVX2-only
CPU (``perf.precision`` reads the variable the same way). Each pair runs the default command and the same
command with ``--training.mixed_precision_param float32`` back to back (the order alternating), so that load
on the machine falls on both. Wall time is the whole command (start-up, validation, checkpoint, export);
tokens/s is the median of the step lines after the first quarter. ``--old-default-steps N`` also times N
steps of the previous default (bf16 whatever the CPU) on the emulated CPU, for the cost the change removes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from qwen3_titan_common.perf.precision import describe_cpu
from qwen3_titan_common.perf.train_log import parse_step_lines

from tools.bench_dense_common import TRAIN, cpu_env

BACKEND = "native-backend"
FP32 = ["--training.mixed_precision_param", "float32"]
WITHOUT_BF16 = {"ONEDNN_MAX_CPU_ISA": "AVX2"}


def one_run(extra: list[str], env_extra: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, median tokens/s, the run's [precision] line) of `train` with ``extra`` flags."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.run(
            [TRAIN, "--out", f"{tmp}/out", *extra],
            env={**cpu_env(BACKEND), **env_extra}, capture_output=True, text=True, cwd=tmp,
        )  # fmt: skip
        wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"train {' '.join(extra)} failed:\n{log[-3000:]}")
    steps = parse_step_lines(log)
    precision = next(
        (line.split("[precision] ", 1)[1] for line in log.splitlines() if "[precision] " in line), "?"
    )
    return wall, statistics.median(s.tokens_per_second for s in steps[len(steps) // 4 :]), precision


def pairs(count: int, env_extra: dict[str, str]) -> dict[str, list[tuple[float, float, str]]]:
    runs: dict[str, list] = {"default": [], "fp32": []}
    for i in range(count):
        order = [("default", []), ("fp32", FP32)]
        for name, extra in order if i % 2 == 0 else order[::-1]:
            runs[name].append(one_run(extra, env_extra))
    return runs


def report(title: str, runs: dict[str, list[tuple[float, float, str]]]) -> None:
    default_wall = statistics.median(r[0] for r in runs["default"])
    fp32_wall = statistics.median(r[0] for r in runs["fp32"])
    default_tps = statistics.median(r[1] for r in runs["default"])
    fp32_tps = statistics.median(r[1] for r in runs["fp32"])
    print(f"{title}: the default computes in: {runs['default'][0][2]}")
    print(
        f"  default: {default_wall:.1f} s, {default_tps:,.0f} tok/s; "
        f"--training.mixed_precision_param float32: {fp32_wall:.1f} s, {fp32_tps:,.0f} tok/s "
        f"(medians of {len(runs['default'])} interleaved pairs)"
    )
    ratio = fp32_wall / default_wall
    verdict = "met" if ratio >= 0.95 else "MISSED"
    print(
        f"  {title}: default no slower than fp32 (target wall-time ratio fp32/default >= 0.95, "
        f"the noise of a pair): {ratio:.2f}: {verdict}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--old-default-steps", type=int, default=0)
    args = parser.parse_args()
    print(describe_cpu())
    report("this CPU", pairs(args.pairs, {}))
    report("this CPU without bf16 instructions (ONEDNN_MAX_CPU_ISA=AVX2)", pairs(args.pairs, WITHOUT_BF16))
    if args.old_default_steps:
        steps = ["--steps", str(args.old_default_steps), "--checkpoint.no-enable", "--hf.no-export"]
        _, old_tps, _ = one_run(
            [*steps, "--validator.no-enable", "--training.mixed_precision_param", "bfloat16"], WITHOUT_BF16
        )
        _, new_tps, _ = one_run([*steps, "--validator.no-enable"], WITHOUT_BF16)
        print(
            f"the previous default (bf16 on every CPU) without bf16 instructions: {old_tps:,.0f} tok/s against "
            f"{new_tps:,.0f} for today's ({new_tps / old_tps:.1f}x; {args.old_default_steps} steps each)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
