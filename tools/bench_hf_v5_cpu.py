"""Benchmark: hf-v5-backend vs native-backend vs a plain transformers loop, on the CPU.

    uv run python -m tools.bench_hf_v5_cpu [--repeats 3] [--steps 25] [--fp32] [--tensor-parallel 2]

All three train the embedded default (`debug`: batch 8 x seq 256, AdamW, the same config.json)
on the CPU. The two backends run through `train` (QWEN3_TITAN_BACKEND selects each), tokens/s
read from their step lines (`tps:`), median over the steps after the first quarter (warm-up);
the plain loop is transformers' Qwen3ForCausalLM with SDPA, a hand-written AdamW step, fp32 (its
default) and with bf16 autocast (closest to the trainers' bf16 mixed precision). Backend runs
alternate (native, hf-v5, native, ...) so that load from other processes hits both alike.

Then the same comparison of hf-v5 and native paired step by step in one process (forward+backward
through each backend's own FSDP2 wrapping): robust to the load other processes put on the machine.

Targets (issue 4): hf-v5 >= 0.9x native, and above the plain loop (fp32, its default), judged on
the fastest of the repeats: other processes on the machine only ever slow a run down.

``--tensor-parallel N``: only the two backends, each as ``train --nproc N --parallelism.tensor_parallel_degree N``
(sequence parallel, gloo), alternating; rank 0's tokens/s and the step time of hf-v5 against native's.
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

from qwen3_titan_common.perf.precision import describe_cpu

from tools.bench_dense_common import ROOT, trainer_tokens_per_second, transformers_loop_in_subprocess


def paired_steps(steps: int, mixed_precision_param: str) -> float:
    """hf-v5 / native speed of forward+backward, alternating the two models step by step in one process.

    Each model goes through its backend's own parallelize function (FSDP2 with mixed precision on a
    one-rank gloo group, as `train` runs it); the median of the per-pair ratios cancels most of the
    load other processes put on the machine, which the separate `train` runs above cannot.
    """
    import torch
    import torch.distributed as dist
    from qwen3_titan_common.assets import default_architecture
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
    from qwen3_titan_hf_v5.model import hf_v5_model_spec
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        dist_utils.set_spmd_backend("spmd_types")
        dims = ParallelDims.from_config(ParallelismConfig(), 1)
        dims.build_mesh()
        arch = default_architecture()
        models = []
        for spec in (titan_qwen3_model_spec(arch, "debug"), hf_v5_model_spec(arch, "debug")):
            with torch.device("meta"):
                model = spec.model.build()
            model = spec.parallelize_fn(
                model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param=mixed_precision_param),
                parallelism=ParallelismConfig(), compile_config=CompileConfig(), ac_config=None, dump_folder="",
            )  # fmt: skip
            model.to_empty(device="cpu")
            with torch.no_grad():
                model.init_weights(buffer_device=None)
            models.append(model)
        generator = torch.Generator().manual_seed(0)
        tokens, labels = torch.randint(0, arch.vocab_size, (2, 8, 256), generator=generator)
        ratios = []
        for _ in range(steps):
            seconds = []
            for model in models:
                start = time.perf_counter()
                logits = model(tokens)
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
                model.zero_grad()
                seconds.append(time.perf_counter() - start)
            ratios.append(seconds[0] / seconds[1])
        dist.destroy_process_group()
    return statistics.median(ratios[len(ratios) // 4 :])


def _paired_in_subprocess(steps: int, mixed_precision_param: str) -> float:
    code = (
        "import json; from tools import bench_hf_v5_cpu as b; "
        f"print(json.dumps(b.paired_steps({steps}, {mixed_precision_param!r})))"
    )
    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(values: list[float]) -> tuple[float, float, float]:
    values = sorted(values)
    return statistics.median(values), values[0], values[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--fp32", action="store_true", help="trainers in fp32 (no bf16 mixed precision)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="both backends at this TP degree only")
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are
    extra = ["--training.mixed_precision_param", "float32"] if args.fp32 else []
    if args.tensor_parallel > 1:
        return _tensor_parallel(args, extra)
    runs: dict[str, list[float]] = {"native": [], "hf_v5": [], "plain_fp32": [], "plain_bf16_autocast": []}
    for _ in range(args.repeats):
        runs["native"].append(trainer_tokens_per_second("native-backend", args.steps, extra))
        runs["hf_v5"].append(trainer_tokens_per_second("hf-v5-backend", args.steps, extra))
        runs["plain_fp32"].append(transformers_loop_in_subprocess(args.steps, False))
        runs["plain_bf16_autocast"].append(transformers_loop_in_subprocess(args.steps, True))
    figures = {name: _summary(values) for name, values in runs.items()}
    precision = "fp32" if args.fp32 else "bf16 mixed precision"
    print(f"CPU, debug model (batch 8 x seq 256), tokens/s over {args.repeats} runs: median (min-max)")
    print(f"  trainers in {precision}; plain transformers loop in fp32 and with bf16 autocast")
    for name, (median, low, high) in figures.items():
        print(f"  {name:<22} {median:>10,.1f}  ({low:,.1f}-{high:,.1f})")
    # Other processes only ever slow a run down: the fastest repeat is the least disturbed one,
    # so the targets are judged on it (the medians are printed above).
    best = {name: high for name, (_, _, high) in figures.items()}
    ratio = best["hf_v5"] / best["native"]
    print(
        f"hf-v5 / native (fastest runs): {ratio:.2f}x (target >= 0.9x): {'met' if ratio >= 0.9 else 'MISSED'}"
    )
    plain = best["plain_fp32"]
    print(
        f"hf-v5 / plain fp32 loop (fastest runs): {best['hf_v5'] / plain:.2f}x (target > 1x): "
        f"{'met' if best['hf_v5'] > plain else 'MISSED'}; "
        f"{best['hf_v5'] / best['plain_bf16_autocast']:.2f}x its bf16-autocast variant"
    )
    for precision in ("bfloat16", "float32"):
        paired = _paired_in_subprocess(args.steps, precision)
        figures[f"paired_hf_v5_over_native_{precision}"] = (paired, paired, paired)
        print(f"hf-v5 / native, paired steps in one process ({precision} params): {paired:.2f}x")
    spread = max(
        (high - low) / median for name, (median, low, high) in figures.items() if "paired" not in name
    )
    if spread > 0.25:
        print(f"note: runs spread by up to {spread:.0%} of their median: the CPU was busy, figures are noisy")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def _tensor_parallel(args, extra: list[str]) -> int:
    degree = str(args.tensor_parallel)
    layout = ["--nproc", degree, "--parallelism.tensor_parallel_degree", degree, *extra]
    runs: dict[str, list[float]] = {"native": [], "hf_v5": []}
    for _ in range(args.repeats):
        runs["native"].append(trainer_tokens_per_second("native-backend", args.steps, layout))
        runs["hf_v5"].append(trainer_tokens_per_second("hf-v5-backend", args.steps, layout))
    figures = {name: _summary(values) for name, values in runs.items()}
    precision = "fp32" if args.fp32 else "bf16 mixed precision"
    print(
        f"CPU, debug model (batch 8 x seq 256), tensor parallel {degree} over {degree} gloo ranks, {precision}; "
        f"rank 0's tokens/s over {args.repeats} runs each: median (min-max)"
    )
    for name, (median, low, high) in figures.items():
        print(f"  {name:<8} {median:>10,.1f}  ({low:,.1f}-{high:,.1f})")
    best = {name: high for name, (_, _, high) in figures.items()}
    print(
        f"hf-v5 TP {degree} step time / native TP {degree} (fastest runs): {best['native'] / best['hf_v5']:.2f}x "
        f"(medians: {figures['native'][0] / figures['hf_v5'][0]:.2f}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
