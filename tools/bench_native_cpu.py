"""Benchmark: the embedded default on native-backend vs a plain transformers loop (CPU).

    uv run python -m tools.bench_native_cpu [--repeats 3] [--steps 25]
    uv run python -m tools.bench_native_cpu --launch-against OTHER/.venv/bin/train [--pairs 7]
    uv run python -m tools.bench_native_cpu --launch-against-rev REV [--pairs 7]

Prints (issue 2's targets):
  - launch to first optimizer step of `train` (the default config), target < 10 s (issue 14), and the
    launcher's own part of it (the checks before launch, parsed config included); with --launch-against
    (another checkout's `train`) or --launch-against-rev (a git worktree of REV made here, with its own locked
    environment from uv's cache), only this row, in interleaved pairs, alternating which side goes first;
  - tokens/s of the `debug` model through torchtitan's Trainer, eager and with
    `--compile.enable`, against a plain transformers `Qwen3ForCausalLM` training loop
    with the same shape, batch, sequence length and optimizer (fp32, the plain
    default; and with bf16 autocast, matching torchtitan's bf16 mixed precision);
    target: native >= 1.5x the plain loop.
Medians over repeats, with the spread. Runs are sequential on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qwen3_titan_common.perf.precision import describe_cpu

from tools.bench_dense_common import (
    QUIET,
    TRAIN,
    cpu_env,
    trainer_tokens_per_second,
    transformers_loop_in_subprocess,
)

BACKEND = "native-backend"


def launch_timeline(train: str = TRAIN) -> tuple[float, float]:
    """Seconds from starting `train` to torchrun's start (the launcher's own work) and to the first
    step line."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [train, "--training.steps", "1", *QUIET, "--dump_folder", f"{tmp}/out"],
            env=cpu_env(BACKEND), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp,
        )  # fmt: skip
        launched = first_step = None
        for line in proc.stdout:
            if launched is None and line.startswith("[train] ") and "torchrun" in line:
                launched = time.perf_counter() - start
            if "step:" in line and "loss:" in line and first_step is None:
                first_step = time.perf_counter() - start
        proc.wait()
    if launched is None or first_step is None:
        raise RuntimeError("train printed no torchrun line or no step line")
    return launched, first_step


def torch_import_seconds() -> float:
    """Seconds for a fresh interpreter to import torch: this machine's speed at the moment, beside the
    launch figure (a launch imports torch three times, two of them one after the other)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def time_to_first_step() -> float:
    """Seconds from starting `train` to its first step line."""
    return launch_timeline()[1]


def _measure(fn, repeats: int) -> tuple[float, float, float]:
    values = sorted(fn() for _ in range(repeats))
    return statistics.median(values), values[0], values[-1]


def launch_pairs(other_train: str, pairs: int) -> int:
    """The launch row against another checkout's ``train`` (e.g. the commit before), in interleaved
    pairs, so that the machine's load at the moment weighs on both sides alike."""
    ours, theirs = [], []
    for i in range(pairs):
        order = [(ours, TRAIN), (theirs, other_train)]
        for figures, train in order if i % 2 == 0 else reversed(order):
            figures.append(launch_timeline(train)[1])
    for name, figures in (("this checkout", ours), (other_train, theirs)):
        print(f"launch to first step, {name}: median {statistics.median(figures):.2f} s "
              f"(min {min(figures):.2f}, max {max(figures):.2f}, {pairs} runs)")  # fmt: skip
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    print(
        f"difference of medians: {statistics.median(ours) - statistics.median(theirs):+.2f} s; median of the "
        f"pairs' ratios {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
    )
    return 0


def launch_pairs_against_rev(rev: str, pairs: int) -> int:
    """:func:`launch_pairs` against ``rev``'s ``train``, from a git worktree with its own locked environment."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(where), rev], check=True)
        try:
            subprocess.run(["uv", "sync", "--locked", "--quiet"], cwd=where, check=True)
            return launch_pairs(str(where / ".venv" / "bin" / "train"), pairs)
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(where)], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--launch-against", metavar="TRAIN", default=None,
        help="only the launch row, in interleaved pairs against this other checkout's train script",
    )  # fmt: skip
    parser.add_argument(
        "--launch-against-rev", metavar="REV", default=None,
        help="only the launch row, in interleaved pairs against a git worktree of REV (e.g. f20a55e)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--pairs", type=int, default=7, help="pairs of launches with --launch-against(-rev)")
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are
    if args.launch_against:
        return launch_pairs(args.launch_against, args.pairs)
    if args.launch_against_rev:
        return launch_pairs_against_rev(args.launch_against_rev, args.pairs)
    n, r = args.steps, args.repeats
    timelines = [launch_timeline() for _ in range(r)]

    def _spread(values: list[float]) -> tuple[float, float, float]:
        values = sorted(values)
        return statistics.median(values), values[0], values[-1]

    figures = {
        "launcher_before_torchrun_s": _spread([t[0] for t in timelines]),
        "launch_to_first_step_s": _spread([t[1] for t in timelines]),
        "python_import_torch_s": _measure(torch_import_seconds, r),
        "native_eager_tps": _measure(lambda: trainer_tokens_per_second(BACKEND, n, []), r),
        "native_compiled_tps": _measure(
            lambda: trainer_tokens_per_second(BACKEND, n, ["--compile.enable"]), r
        ),
        "transformers_fp32_tps": _measure(lambda: transformers_loop_in_subprocess(n, False), r),
        "transformers_bf16_autocast_tps": _measure(lambda: transformers_loop_in_subprocess(n, True), r),
    }
    print(f"CPU, debug model (batch 8 x seq 256), medians of {r} runs (min-max):")
    for name, (median, low, high) in figures.items():
        print(f"  {name:<32} {median:>10,.1f}  ({low:,.1f}-{high:,.1f})")
    first = figures["launch_to_first_step_s"][0]
    print(f"launch to first step: {first:.1f} s (target < 10 s): {'met' if first < 10 else 'MISSED'}")
    print(
        f"  this machine now: `import torch` takes {figures['python_import_torch_s'][0]:.2f} s in a fresh "
        "interpreter (the launch imports it twice in a row: torchrun's agent, then the rank)"
    )
    plain = figures["transformers_fp32_tps"][0]
    plain_bf16 = figures["transformers_bf16_autocast_tps"][0]
    for name in ("native_eager_tps", "native_compiled_tps"):
        ratio = figures[name][0] / plain
        print(
            f"{name}: {ratio:.2f}x the plain transformers loop (target >= 1.5x): "
            f"{'met' if ratio >= 1.5 else 'MISSED'}; {figures[name][0] / plain_bf16:.2f}x its bf16-autocast variant"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
