"""Benchmark: a real-width Qwen3 on one CPU rank, both backends through `train`, against a plain loop.

    uv run python -m tools.bench_real_width [--pairs 2] [--steps 8] [--layers 8] [--seq 1024]

The model is Qwen3-0.6B's shape (hidden 1024, 16 query and 8 kv heads of 128, MLP 3072, the 151,936-token
vocabulary, tied) cut to ``--layers`` layers, written by transformers' ``save_pretrained`` in bf16 as the
published weights are (``tools.bench_memory.make_real_width``). One row of ``--seq`` tokens a step. Sides, in
interleaved rounds so that the machine's slow phases hit every side alike:
  - native-backend and hf-v5-backend: `train --hf-model DIR --batch-size 1 --seq-len SEQ` (the embedded
    default's text, every token trained), without checkpoint, export or validation; tokens/s is the median of
    the step lines after the first, peak memory the largest step line's (the rank's host RSS);
  - the plain loop: transformers' ``Qwen3ForCausalLM`` from the same directory, fp32 weights, SDPA, fused
    AdamW (torchtitan's betas and weight decay), gradient clipping at 1.0, cross-entropy over the whole
    row's logits, random token ids (the speed does not depend on them), in a fresh process; its peak is the
    process's maximum RSS.
Both sides compute in this CPU's default precision (``perf.precision``): bf16 where it has bf16 matrix
instructions (ours: fp32 weights and bf16 autocast on one rank; the loop: bf16 autocast), fp32 elsewhere.
Targets (issue 42): native >= 1.3x the loop's tokens/s, native's peak no higher than the loop's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qwen3_titan_common.perf.precision import default_compute_precision, describe_cpu

from tools.bench_dense_common import QUIET, ROOT, TRAIN, cpu_env

TARGET_SPEED = 1.3


def plain_loop(model_dir: str, seq: int, steps: int, bf16: bool) -> dict:
    """tokens/s (median after the first step) and peak RSS of the plain transformers loop."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    generator = torch.Generator().manual_seed(0)
    rates = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.vocab_size, (1, seq + 1), generator=generator)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[0, 1:])
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        rates.append(seq / (time.perf_counter() - start))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    return {"tokens_per_second": statistics.median(rates[1:]), "peak_gib": peak}


def _plain_in_subprocess(model_dir: Path, seq: int, steps: int, bf16: bool) -> dict:
    code = (
        "import json; from tools import bench_real_width as b; "
        f"print(json.dumps(b.plain_loop({str(model_dir)!r}, {seq}, {steps}, {bf16!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=cpu_env(), capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _train(backend: str, model_dir: Path, seq: int, steps: int, work: Path) -> dict:
    from qwen3_titan_common.perf.train_log import parse_step_lines

    out = subprocess.run(
        [TRAIN, "--hf-model", str(model_dir), "--batch-size", "1", "--seq-len", str(seq), "--steps", str(steps),
         *QUIET, "--validator.no-enable", "--out", str(work / backend)],
        env=cpu_env(backend), capture_output=True, text=True, cwd=work,
    )  # fmt: skip
    lines = parse_step_lines(out.stdout + out.stderr)
    if out.returncode != 0 or len(lines) < steps:
        raise RuntimeError(f"{backend}: train failed\n{(out.stdout + out.stderr)[-3000:]}")
    return {
        "tokens_per_second": statistics.median(line.tokens_per_second for line in lines[1:]),
        "peak_gib": max(line.memory_gib for line in lines if line.memory_gib is not None),
    }


def main() -> int:
    from tools.bench_memory import make_real_width

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=2, help="interleaved rounds of every side")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    print(describe_cpu(), flush=True)
    bf16 = default_compute_precision("cpu").dtype == "bfloat16"
    runs: dict[str, list[dict]] = {"native": [], "hf_v5": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = make_real_width(work / "model", args.layers)
        for round_ in range(args.pairs):
            for side, measure in (
                ("native", lambda: _train("native-backend", model_dir, args.seq, args.steps, work)),
                ("plain", lambda: _plain_in_subprocess(model_dir, args.seq, args.steps, bf16)),
                ("hf_v5", lambda: _train("hf-v5-backend", model_dir, args.seq, args.steps, work)),
            ):
                runs[side].append(measure())
                print(f"round {round_ + 1} {side}: {runs[side][-1]}", flush=True)
    figures = {
        side: {
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in results),
            "tokens_per_second_range": [min(r["tokens_per_second"] for r in results),
                                        max(r["tokens_per_second"] for r in results)],
            "peak_gib": max(r["peak_gib"] for r in results),
        }
        for side, results in runs.items()
    }  # fmt: skip
    precision = "bf16 compute, fp32 weights" if bf16 else "fp32"
    print(
        f"\nQwen3-0.6B shape, {args.layers} layers, 1 x {args.seq} tokens a step, one CPU rank, {precision}:"
    )
    print("| side | tokens/s (median, range) | peak GiB |\n|---|---|---|")
    for side, fig in figures.items():
        low, high = fig["tokens_per_second_range"]
        print(f"| {side} | {fig['tokens_per_second']:.1f} ({low:.1f}-{high:.1f}) | {fig['peak_gib']:.2f} |")
    plain = figures["plain"]
    for side in ("native", "hf_v5"):
        speed = figures[side]["tokens_per_second"] / plain["tokens_per_second"]
        fig = figures[side]
        print(
            f"{side} / plain loop: {speed:.2f}x tokens/s (target >= {TARGET_SPEED}x: "
            f"{'met' if speed >= TARGET_SPEED else 'MISSED'}); peak {fig['peak_gib']:.2f} vs "
            f"{plain['peak_gib']:.2f} GiB ({'met' if fig['peak_gib'] <= plain['peak_gib'] else 'MISSED'})"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "figures": figures}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("QWEN3_TITAN_DEVICE", "cpu")
    sys.exit(main())
