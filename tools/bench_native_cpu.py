"""Benchmark: the embedded default on native-backend vs a plain transformers loop (CPU).

    uv run python tools/bench_native_cpu.py [--repeats 3] [--steps 25]

Prints (issue 2's targets):
  - launch to first optimizer step of `train` (the default config), target < 15 s;
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
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = str(Path(sys.executable).with_name("train"))
ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
QUIET = ["--checkpoint.no-enable", "--hf.no-export"]


def time_to_first_step() -> float:
    """Seconds from starting `train` to its first step line."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [TRAIN, "--training.steps", "1", *QUIET, "--dump_folder", tmp],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp,
        )  # fmt: skip
        elapsed = None
        for line in proc.stdout:
            if "step:" in line and "loss:" in line and elapsed is None:
                elapsed = time.perf_counter() - start
        proc.wait()
    if elapsed is None:
        raise RuntimeError("train printed no step line")
    return elapsed


def trainer_tokens_per_second(steps: int, extra: list[str]) -> float:
    from qwen3_titan_common.train_log import parse_step_lines

    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [TRAIN, "--training.steps", str(steps), *QUIET, "--dump_folder", tmp, *extra],
            env=ENV, capture_output=True, text=True, cwd=tmp, check=True,
        )  # fmt: skip
    lines = parse_step_lines(out.stdout + out.stderr)
    warm = lines[len(lines) // 4 :]  # skip warm-up (and compilation) steps
    return statistics.median(s.tokens_per_second for s in warm)


def transformers_loop(steps: int, autocast_bf16: bool) -> float:
    """A plain training loop: the debug architecture as transformers' Qwen3ForCausalLM."""
    import torch
    from qwen3_titan_native.config_registry import debug
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = debug()
    source = dict(config.architecture.source)
    source.pop("architectures", None)
    model = Qwen3ForCausalLM(Qwen3Config(**source, attn_implementation="sdpa"))
    lr = config.optimizer.param_groups[0].optimizer_kwargs["lr"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    batch, seq = config.training.local_batch_size, config.training.seq_len
    tokens = torch.randint(
        0, source["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    rates = []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        rates.append(batch * seq / (time.perf_counter() - start))
    return statistics.median(rates[len(rates) // 4 :])


def _loop_in_subprocess(steps: int, autocast_bf16: bool) -> float:
    here = str(Path(__file__).parent)
    code = (
        f"import sys, json; sys.path.insert(0, {here!r}); import bench_native_cpu as b; "
        f"print(json.dumps(b.transformers_loop({steps}, {autocast_bf16!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(fn, repeats: int) -> tuple[float, float, float]:
    values = sorted(fn() for _ in range(repeats))
    return statistics.median(values), values[0], values[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    n, r = args.steps, args.repeats
    figures = {
        "launch_to_first_step_s": _measure(time_to_first_step, r),
        "native_eager_tps": _measure(lambda: trainer_tokens_per_second(n, []), r),
        "native_compiled_tps": _measure(lambda: trainer_tokens_per_second(n, ["--compile.enable"]), r),
        "transformers_fp32_tps": _measure(lambda: _loop_in_subprocess(n, False), r),
        "transformers_bf16_autocast_tps": _measure(lambda: _loop_in_subprocess(n, True), r),
    }
    print(f"CPU, debug model (batch 8 x seq 256), medians of {r} runs (min-max):")
    for name, (median, low, high) in figures.items():
        print(f"  {name:<32} {median:>10,.1f}  ({low:,.1f}-{high:,.1f})")
    first = figures["launch_to_first_step_s"][0]
    print(f"launch to first step: {first:.1f} s (target < 15 s): {'met' if first < 15 else 'MISSED'}")
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
