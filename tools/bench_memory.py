"""Benchmark: the dry run's memory estimate against the peak a real run measures, one row per setting.

    uv run python tools/bench_memory.py [--quick] [--json FILE]
    uv run python tools/bench_memory.py --growth [--json FILE]
    uv run python tools/bench_memory.py --long [--json FILE]

Each row runs ``train --dry-run`` (rank 0's estimate: torch's memory tracker over two fake steps, plus the
process's own memory on the CPU, ``perf.memory``) and then the same command for real, three steps (the
optimizer's state exists from the second), and compares the estimate with the largest peak the step lines
print (rank 0's host RSS on the CPU, the caching allocator's reserved bytes on CUDA). Both sides in the same
run, same flags. Target (issue 39): every row within 15%.

The rows: the debug configs (dense and MoE), and a real-width Qwen3 (Qwen3-0.6B's hidden size, heads and
151,936-token vocabulary, cut to 4 and 8 layers, written by transformers' ``save_pretrained`` in bf16 as the
published weights are) at batch 1-8 and seq 256-1024, with and without activation checkpointing, on 1 and 2
ranks. The machine's 2 cores set the sizes: a real-width step of 4,096 tokens takes about a minute.

``--long`` runs the long-row rows instead: the embedded model's width with its positions raised to 16,384 in its
``config.json``, one row of 8,192 and of 16,384 tokens, on one rank and on 2 context-parallel ranks
(``models.context_parallel``); each row also reports its tokens/s per rank (the step lines' tps after the
first step), so CP 2 against CP 1 is read off the same table.

``--growth`` measures instead whether a long run's peak levels off: the debug MoE (the experts' row counts change
every step) for 60 steps, its peak at step 10 against step 60. Target: under 2 MiB a step after step 10 (the
CPU's grouped GEMMs once grew it by ~27 MiB a step, one oneDNN primitive per row count). The host RSS is a
high-water mark that glibc's heap and the routing of a step move by tens of MiB, so a test's dozen steps cannot
tell this apart from noise; sixty steps can.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = str(Path(sys.executable).with_name("train"))
TARGET = 0.15
STEPS = 3
GROWTH_STEPS, GROWTH_FROM, GROWTH_TARGET_MIB = 60, 10, 2.0
_ESTIMATE = re.compile(r"total ~([0-9.]+) GiB")
_KINDS = re.compile(r"GiB: (.*?); total")
# Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B), cut to fewer layers.
REAL_WIDTH = dict(
    hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
)  # fmt: skip
QUIET = (
    "--checkpoint.no-enable",
    "--hf.no-export",
    "--validator.no-enable",
    "--metrics.no-enable-tensorboard",
)


def make_real_width(directory: Path, layers: int) -> Path:
    """A real-width Qwen3 of ``layers`` layers with the real Qwen3 tokenizer beside it."""
    import torch
    from qwen3_titan_testing.qwen3_tokenizer import qwen3_tokenizer_dir
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**REAL_WIDTH, num_hidden_layers=layers, dtype="bfloat16")
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    qwen3_tokenizer_dir(directory)
    return directory


LONG_POSITIONS = 16384


def make_long_debug(directory: Path) -> Path:
    """The embedded model's architecture with ``max_position_embeddings`` raised to :data:`LONG_POSITIONS`, random
    weights written by transformers, its tokenizer beside them."""
    import torch
    from qwen3_titan_common.assets import default_model_dir, default_tokenizer_dir
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    source = json.loads((default_model_dir() / "config.json").read_text())
    torch.manual_seed(0)
    config = Qwen3Config.from_dict({**source, "max_position_embeddings": LONG_POSITIONS})
    Qwen3ForCausalLM(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(default_tokenizer_dir())).save_pretrained(directory)
    return directory


def long_rows(model: Path) -> list[tuple[str, str, list[str]]]:
    """One row of 8,192 and of 16,384 tokens, on one rank and on 2 context-parallel ranks."""
    table = []
    for seq in (8192, LONG_POSITIONS):
        for ranks in (1, 2):
            layout = ["--nproc", "2", "--parallelism.context_parallel_degree", "2"] if ranks == 2 else []
            name = f"debug width, batch 1 x {seq}, " + ("CP 2 (2 ranks)" if ranks == 2 else "1 rank")
            args = ["--hf-model", str(model), "--batch-size", "1", "--seq-len", str(seq), *layout]
            table.append((name, "native-backend", args))
    return table


def rows(models: dict[str, Path], quick: bool) -> list[tuple[str, str, list[str]]]:
    """(name, package, train arguments) per row."""
    w4, w8 = ["--hf-model", str(models["w4"])], ["--hf-model", str(models["w8"])]

    def shape(batch: int, seq: int) -> list[str]:
        return ["--batch-size", str(batch), "--seq-len", str(seq)]

    table = [
        ("debug dense, batch 8 x 256", "native-backend", []),
        ("debug MoE, batch 8 x 256", "nki-moe-backend", []),
        ("real width 4 layers, batch 1 x 256", "native-backend", [*w4, *shape(1, 256)]),
        ("real width 4 layers, batch 8 x 256", "native-backend", [*w4, *shape(8, 256)]),
        ("real width 4 layers, batch 2 x 1024", "native-backend", [*w4, *shape(2, 1024)]),
        ("real width 4 layers, batch 2 x 1024, full AC", "native-backend",
         [*w4, *shape(2, 1024), "activation-checkpoint:full"]),
        ("real width 4 layers, batch 4 x 512, selective AC", "native-backend",
         [*w4, *shape(4, 512), "activation-checkpoint:selective"]),
        ("real width 8 layers, batch 1 x 1024", "native-backend", [*w8, *shape(1, 1024)]),
        ("real width 4 layers, batch 1 x 512, 2 ranks (FSDP)", "native-backend",
         [*w4, *shape(1, 512), "--nproc", "2"]),
        ("real width 4 layers, batch 2 x 512, hf-v5", "hf-v5-backend", [*w4, *shape(2, 512)]),
    ]  # fmt: skip
    return table[:4] if quick else table


def run_row(package: str, args: list[str], work: Path) -> dict:
    from qwen3_titan_common.launcher.titan_flags import before_subcommands
    from qwen3_titan_common.perf.train_log import parse_step_lines

    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": package}
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    dry = subprocess.run(
        [TRAIN, *before_subcommands(args, ("--dry-run", "--out", str(out)))],
        env=env, capture_output=True, text=True, cwd=work,
    )  # fmt: skip
    found = _ESTIMATE.search(dry.stdout)
    if dry.returncode != 0 or not found:
        raise RuntimeError(f"dry run failed ({dry.returncode}):\n{dry.stdout[-2000:]}{dry.stderr[-2000:]}")
    start = time.perf_counter()
    real = subprocess.run(
        [TRAIN, *before_subcommands(args, ("--steps", str(STEPS), *QUIET, "--out", str(out)))],
        env=env, capture_output=True, text=True, cwd=work,
    )  # fmt: skip
    lines = parse_step_lines(real.stdout + real.stderr)
    if real.returncode != 0 or len(lines) < STEPS:
        raise RuntimeError(f"run failed ({real.returncode}):\n{(real.stdout + real.stderr)[-3000:]}")
    estimate = float(found.group(1))
    measured = max(line.memory_gib for line in lines if line.memory_gib is not None)
    after_first = sorted(line.tokens_per_second for line in lines if line.step > 1)
    return {
        "estimate_gib": estimate,
        "measured_gib": measured,
        "ratio": round(measured / estimate, 3),
        "tps_per_rank": after_first[len(after_first) // 2] if after_first else None,
        "kinds": _KINDS.search(dry.stdout).group(1),
        "seconds": round(time.perf_counter() - start, 1),
    }


def growth_row(work: Path) -> dict:
    """The debug MoE's peak at step GROWTH_FROM and at its last step, and the growth per step between them."""
    from qwen3_titan_common.perf.train_log import parse_step_lines

    env = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "nki-moe-backend"}
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    real = subprocess.run(
        [TRAIN, "--steps", str(GROWTH_STEPS), *QUIET, "--out", str(out)],
        env=env, capture_output=True, text=True, cwd=work,
    )  # fmt: skip
    peaks = {line.step: line.memory_gib for line in parse_step_lines(real.stdout + real.stderr)}
    if real.returncode != 0 or len(peaks) < GROWTH_STEPS:
        raise RuntimeError(f"run failed ({real.returncode}):\n{(real.stdout + real.stderr)[-3000:]}")
    start, end = peaks[GROWTH_FROM], peaks[GROWTH_STEPS]
    return {
        "row": f"debug MoE, steps {GROWTH_FROM} to {GROWTH_STEPS}",
        "peak_start_gib": start,
        "peak_end_gib": end,
        "mib_per_step": round((end - start) * 1024 / (GROWTH_STEPS - GROWTH_FROM), 2),
    }


def main_growth(json_path: Path | None) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = growth_row(Path(tmp))
    print("| row | peak at start GiB | peak at end GiB | growth MiB / step | under target |")
    print("|---|---|---|---|---|")
    ok = result["mib_per_step"] < GROWTH_TARGET_MIB
    print(
        f"| {result['row']} | {result['peak_start_gib']:.2f} | {result['peak_end_gib']:.2f} "
        f"| {result['mib_per_step']:.2f} | {'yes' if ok else '**no**'} (< {GROWTH_TARGET_MIB}) |"
    )
    if json_path:
        json_path.write_text(json.dumps([result], indent=1))
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the first four rows only")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    parser.add_argument("--growth", action="store_true", help="whether a 60-step MoE run's peak levels off")
    parser.add_argument("--long", action="store_true", help="the long-row rows (8k, 16k; CP 1 and 2)")
    opts = parser.parse_args()
    if opts.growth:
        return main_growth(opts.json)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if opts.long:
            table = long_rows(make_long_debug(work / "long"))
        else:
            models = {name: make_real_width(work / name, layers) for name, layers in (("w4", 4), ("w8", 8))}
            table = rows(models, opts.quick)
        print(
            "| row | estimate GiB | measured peak GiB | measured / estimate | within 15% | tokens/s per rank "
            "| estimate by kind |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, package, args in table:
            result = run_row(package, args, work) | {"row": name, "backend": package}
            results.append(result)
            ok = abs(result["ratio"] - 1) <= TARGET
            print(
                f"| {name} | {result['estimate_gib']:.2f} | {result['measured_gib']:.2f} | {result['ratio']:.3f} "
                f"| {'yes' if ok else '**no**'} | {result['tps_per_rank']} | {result['kinds']} |",
                flush=True,
            )
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=1))
    missed = [r["row"] for r in results if abs(r["ratio"] - 1) > TARGET]
    print(
        f"{len(results) - len(missed)}/{len(results)} rows within {TARGET:.0%}"
        + (f"; missed: {missed}" if missed else "")
    )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
