"""What fits where: the dry run's memory estimate for each recipe on Trainium2, H100, H200 and a laptop.

    uv run python tools/what_fits.py [--only RECIPE] [--long-only]

Each cell is ``train --dry-run --config C --nproc N --memory-per-rank DEVICE`` (``perf.memory``: torch's memory
tracker over a fake step of the sharded model), at the recipe's own batch, sequence length and activation
checkpointing: the estimate per rank and the verdict, and where it does not fit, what the dry run says fits
by the same estimate. The long-row columns run the same at one row of 32,768 tokens (Qwen3's context), where
the dry run names the smallest context-parallel degree that fits (``models.context_parallel``). The README's
tables are this tool's output; ``tools/bench_memory.py`` measures the estimate against real runs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN = str(Path(sys.executable).with_name("train"))
RECIPES = (
    ("Qwen3-0.6B", "native-backend", "qwen3_0_6b"),
    ("Qwen3-1.7B", "native-backend", "qwen3_1_7b"),
    ("Qwen3-4B", "native-backend", "native_qwen3_4b"),
    ("Qwen3-4B, transformers' model (hf-v5)", "hf-v5-backend", "qwen3_4b"),
    ("Qwen3-30B-A3B", "nki-moe-backend", "qwen3_30b_a3b"),
)
# (column, ranks, --memory-per-rank): one trn2.48xlarge (64 logical cores at LNC=2), 8 GPUs, one laptop process.
DEVICES = (
    ("trn2.48xlarge, 64 ranks of 24 GiB", "64", "trn2"),
    ("8 x H100 80 GB", "8", "h100"),
    ("8 x H200 141 GB", "8", "h200"),
    ("laptop, 1 rank of 16 GiB", "1", "16"),
)
# Long rows: one row of Qwen3's 32,768 tokens on the accelerators.
LONG_ROW = 32768
LONG_DEVICES = DEVICES[:3]
_CP = re.compile(
    r"--parallelism\.context_parallel_degree (\d+) \(each row's tokens over \d+ ranks; ~([0-9.]+) GiB"
)
_RECOMPUTED = re.compile(r"activation-checkpoint:full as the last argument \(~([0-9.]+) GiB\)")
_SHAPE = re.compile(r"at the step's peak \(batch (\d+) x seq (\d+), (\w+) compute")
_TOTAL = re.compile(r"total ~([0-9.]+) GiB")
_HINT = re.compile(r"does not fit, [^;]*; (.*)$")


def _dry_run(package: str, config: str, ranks: str, memory: str, work: Path, *flags: str):
    env = {**os.environ, "QWEN3_TITAN_BACKEND": package, "QWEN3_TITAN_DEVICE": "cpu"}
    return subprocess.run(
        [TRAIN, "--dry-run", "--config", config, "--nproc", ranks, "--memory-per-rank", memory, *flags],
        env=env, capture_output=True, text=True, cwd=work,
    )  # fmt: skip


def long_row_cell(package: str, config: str, ranks: str, memory: str, work: Path) -> str:
    """One row of 32,768 tokens: fits as it is, or the smallest context-parallel degree that fits."""
    proc = _dry_run(package, config, ranks, memory, work, "--seq-len", str(LONG_ROW), "--batch-size", "1")
    total = _TOTAL.search(proc.stdout)
    if total is None:
        return f"dry run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:120]}"
    if proc.returncode == 0:
        return f"fits without CP, {total.group(1)} GiB"
    split, recomputed = _CP.search(proc.stderr), _RECOMPUTED.search(proc.stderr)
    options = []
    if split:
        options.append(f"CP {split.group(1)}, {split.group(2)} GiB")
    if recomputed:
        options.append(f"full recomputation, {recomputed.group(1)} GiB")
    if options:
        return f"{total.group(1)} GiB at CP 1; fits: " + " or ".join(options)
    return f"**no**, {total.group(1)} GiB at CP 1; no CP degree up to {ranks} or recomputation fits"


def cell(package: str, config: str, ranks: str, memory: str, work: Path) -> tuple[str, str]:
    """(the recipe's shape, the cell's text) from one dry run."""
    proc = _dry_run(package, config, ranks, memory, work)
    shape, total = _SHAPE.search(proc.stdout), _TOTAL.search(proc.stdout)
    if shape is None or total is None:
        return "", f"dry run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:120]}"
    described = f"batch {shape.group(1)} x {shape.group(2)}, {shape.group(3)}"
    if proc.returncode == 0:
        near = " (near the limit)" if "memory near the limit" in proc.stdout else ""
        return described, f"fits, {total.group(1)} GiB{near}"
    found = _HINT.search(proc.stderr.strip().splitlines()[-1])
    hint = (
        found.group(1)
        .replace(" by the same estimate", "")
        .replace("--training.local_batch_size (--batch-size)", "batch")
        .replace(", FSDP sharding the weights, gradients and optimizer state over them;", ",")
        if found
        else "?"
    )
    return described, f"**no**, {total.group(1)} GiB; {hint}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=None, help="one recipe (its config name)")
    parser.add_argument("--long-only", action="store_true", help="only the table of one 32,768-token row")
    opts = parser.parse_args()
    recipes = [recipe for recipe in RECIPES if not opts.only or recipe[2] == opts.only]
    with tempfile.TemporaryDirectory() as tmp:
        if not opts.long_only:
            print(
                "| recipe (its batch x seq, precision) | " + " | ".join(name for name, _, _ in DEVICES) + " |"
            )
            print("|---|" + "---|" * len(DEVICES))
            for label, package, config in recipes:
                cells, shape = [], ""
                for _, ranks, memory in DEVICES:
                    described, text = cell(package, config, ranks, memory, Path(tmp))
                    shape = shape or described
                    cells.append(text)
                print(f"| {label} ({shape}) | " + " | ".join(cells) + " |", flush=True)
            print()
        names = " | ".join(f"{name}, one row of {LONG_ROW:,}" for name, _, _ in LONG_DEVICES)
        print(f"| recipe (bf16) | {names} |")
        print("|---|" + "---|" * len(LONG_DEVICES))
        for label, package, config in recipes:
            cells = [
                long_row_cell(package, config, ranks, memory, Path(tmp)) for _, ranks, memory in LONG_DEVICES
            ]
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
