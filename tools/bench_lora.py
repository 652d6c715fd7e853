"""Benchmark: LoRA against full fine-tuning, memory and loss (CPU, native-backend).

    uv run python -m tools.bench_lora [--steps 30] [--skip-1.7b] [--full-depth-full-ft] [--json out.json]

Prints (issue 17's targets):
  - the embedded default (30 steps, batch 8 x seq 256), full fine-tuning and LoRA (rank 16, every
    projection): first and last loss, trainable parameters, optimizer state as the start line reports
    it and as measured in the step checkpoint (the bytes of every ``optimizer.*`` tensor DCP wrote),
    peak host RSS, export size (full directory vs adapter); target: LoRA's optimizer state < 10% of full
    fine-tuning's;
  - the Qwen3-1.7B shape (random weights, batch 1 x seq 64, one CPU rank): ``train --dry-run``'s memory
    per rank for both; a 2-step run of LoRA at full depth, and of both on the shape cut to 4 of its 28
    layers (full fine-tuning at full depth needs ~28 GB of host memory: ``--full-depth-full-ft`` runs it
    where the machine has that), with peak host RSS and seconds per step.

Runs are sequential, one ``train`` at a time; the config of the cut shape is ``qwen3_1_7b_4layers`` below
(``--module tools.bench_lora``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qwen3_titan_common.perf.precision import describe_cpu

from tools.bench_dense_common import ROOT, TRAIN, cpu_env

BACKEND = "native-backend"
LORA = ["--lora.rank", "16", "--lora.alpha", "32"]
_START = re.compile(r"\[params\] trainable ([0-9,]+) of ([0-9,]+) .*optimizer state per rank ([0-9,]+) bytes")
_STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")
_DRY_MEMORY = re.compile(
    r"params ([0-9.]+) GiB, grads ([0-9.]+) GiB, optimizer ([0-9.]+) GiB, activations ~([0-9.]+) GiB.*total ~([0-9.]+) GiB"
)


def qwen3_1_7b_4layers():
    """Qwen3-1.7B's shape cut to 4 of its 28 layers, random init, batch 1 x seq 64 (this benchmark only)."""
    from qwen3_titan_common.arch.published import published_architecture
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
    from qwen3_titan_common.train.config import real_size_shape
    from qwen3_titan_common.train.config_functions import BackendConfigs

    arch = published_architecture("Qwen3-1.7B").with_changes(num_hidden_layers=4)
    return BackendConfigs("native", titan_qwen3_model_spec).config(
        arch, "qwen3_1_7b_4layers", real_size_shape("native", "qwen3_1_7b_4layers")
    )


def _run(args: list[str], cwd: Path) -> tuple[str, float]:
    start = time.perf_counter()
    # The launcher and the rank both import this module for the cut shape's config (--module tools.bench_lora).
    env = {**cpu_env(BACKEND), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([TRAIN, *args], env=env, capture_output=True, text=True, cwd=cwd)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"train {' '.join(args)} failed:\n{log[-3000:]}")
    return log, time.perf_counter() - start


def _start_line(log: str) -> dict:
    found = _START.search(log)
    if not found:
        raise RuntimeError("no [params] start line in the log")
    trainable, total, state = (int(g.replace(",", "")) for g in found.groups())
    return {"trainable": trainable, "total": total, "optimizer_state_bytes_reported": state}


def _checkpoint_optimizer_bytes(step_dir: Path) -> int:
    """Bytes of the optimizer state DCP saved: what the optimizer held after training."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(step_dir)).read_metadata()
    total = 0
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith("optimizer.") and isinstance(entry, TensorStorageMetadata):
            itemsize = entry.properties.dtype.itemsize
            total += math.prod(entry.size) * itemsize
    return total


def _last_step_seconds(log: str) -> float:
    """Seconds between the log stamps of the last two step lines (the step lines' tokens/s is rounded to an
    integer, too coarse for a 64-token step); 64 / tokens per second where the lines carry no stamp."""
    from datetime import datetime

    from qwen3_titan_common.perf.train_log import parse_step_lines

    stamps = [
        datetime.strptime(found.group(0), "%Y-%m-%d %H:%M:%S,%f")
        for line in log.splitlines()
        if parse_step_lines(line) and (found := _STAMP.search(line))
    ]
    if len(stamps) >= 2:
        return (stamps[-1] - stamps[-2]).total_seconds()
    return 64 / parse_step_lines(log)[-1].tokens_per_second


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def embedded_default(steps: int) -> dict:
    from qwen3_titan_common.perf.train_log import parse_step_lines

    results = {}
    for name, extra in (("full", []), ("lora", [*LORA, "--lora.merge"])):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            args = [
                "--training.steps",
                str(steps),
                "--checkpoint.interval",
                str(steps),
                "--dump_folder",
                str(out),
            ]
            log, _ = _run([*args, "--debug.seed", "0", *extra], Path(tmp))
            lines = parse_step_lines(log)
            figures = _start_line(log)
            figures.update(
                first_loss=lines[0].loss,
                last_loss=lines[-1].loss,
                peak_rss_gib=max(s.memory_gib or 0 for s in lines),
                optimizer_state_bytes_measured=_checkpoint_optimizer_bytes(
                    out / "checkpoint" / f"step-{steps}"
                ),
                full_export_bytes=_dir_bytes(out / "hf" / f"step-{steps}"),
            )
            if name == "lora":
                figures["adapter_export_bytes"] = _dir_bytes(out / "hf" / f"adapter-step-{steps}")
            results[name] = figures
    return results


def _dry_run(extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        log, _ = _run(
            ["--dry-run", "--nproc", "1", "--config", "qwen3_1_7b", "--training.seq_len", "64", *extra],
            Path(tmp),
        )
    found = _DRY_MEMORY.search(log)
    if not found:
        raise RuntimeError(f"no memory line in the dry run:\n{log[-2000:]}")
    keys = ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "total_gib")
    return dict(zip(keys, (float(g) for g in found.groups()), strict=True))


def _two_steps(config: list[str], extra: list[str]) -> dict:
    from qwen3_titan_common.perf.train_log import parse_step_lines

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            *config, "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "1",
            "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--checkpoint.no-enable", "--hf.no-export",
            "--dump_folder", str(Path(tmp) / "out"), *extra,
        ]  # fmt: skip
        log, seconds = _run(args, ROOT)
    lines = parse_step_lines(log)
    figures = _start_line(log)
    figures.update(
        peak_rss_gib=max(s.memory_gib or 0 for s in lines),
        seconds_per_step=_last_step_seconds(log),
        wall_s=seconds,
        losses=[s.loss for s in lines],
    )
    print(f"  [{' '.join(config + extra)}] {figures}", flush=True)  # each run as it ends: they take minutes
    return figures


def qwen3_1_7b(full_depth_full_ft: bool) -> dict:
    results = {"dry_run": {"full": _dry_run([]), "lora": _dry_run(LORA)}}
    cut = ["--module", "tools.bench_lora", "--config", "qwen3_1_7b_4layers"]
    results["4_layers"] = {"full": _two_steps(cut, []), "lora": _two_steps(cut, LORA)}
    full = ["--config", "qwen3_1_7b"]
    results["28_layers"] = {"lora": _two_steps(full, LORA)}
    if full_depth_full_ft:
        results["28_layers"]["full"] = _two_steps(full, [])
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-1.7b", dest="skip_17b", action="store_true")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--full-depth-full-ft", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are
    figures = {}
    if not args.skip_embedded:
        figures["embedded_default"] = embedded_default(args.steps)
        _print_embedded(figures["embedded_default"], args.steps)
    if not args.skip_17b:
        big = figures["qwen3_1_7b"] = qwen3_1_7b(args.full_depth_full_ft)
        print("Qwen3-1.7B shape, batch 1 x seq 64, 1 CPU rank:")
        for name, row in big["dry_run"].items():
            print(f"  dry run {name:<5} " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        for depth in ("4_layers", "28_layers"):
            for name, row in big[depth].items():
                print(
                    f"  {depth} {name:<5} 2 steps: peak RSS {row['peak_rss_gib']:.2f} GiB, "
                    f"{row['seconds_per_step']:.1f} s/step, trainable {row['trainable']:,} of {row['total']:,}, "
                    f"optimizer state {row['optimizer_state_bytes_reported']:,} B"
                )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def _print_embedded(results: dict, steps: int) -> None:
    full, lora = results["full"], results["lora"]
    print(f"embedded default, {steps} steps (batch 8 x seq 256):")
    for name, row in (("full fine-tuning", full), ("LoRA rank 16", lora)):
        print(
            f"  {name:<17} loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}; trainable {row['trainable']:,} "
            f"of {row['total']:,}; optimizer state {row['optimizer_state_bytes_measured']:,} B measured "
            f"({row['optimizer_state_bytes_reported']:,} reported); peak RSS {row['peak_rss_gib']:.2f} GiB"
        )
    ratio = lora["optimizer_state_bytes_measured"] / full["optimizer_state_bytes_measured"]
    print(
        f"LoRA optimizer state / full fine-tuning's: {100 * ratio:.2f}% (target < 10%): {'met' if ratio < 0.1 else 'MISSED'}"
    )
    print(
        f"exports: full directory {full['full_export_bytes']:,} B, adapter {lora['adapter_export_bytes']:,} B; "
        f"LoRA lowers the loss: {'met' if lora['last_loss'] < lora['first_loss'] else 'MISSED'}"
    )


if __name__ == "__main__":
    sys.exit(main())
