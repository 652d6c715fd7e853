"""torchtitan rows: one ``tt_run`` process per part, its log read back into a row."""

from __future__ import annotations

import glob
import json
import os
import re

from tools.gpu_bench import trace_summary
from tools.gpu_bench.capped import Clock, run_capped, say, trim_log
from tools.gpu_bench.from_common import parse_step_lines
from tools.gpu_bench.plan import Mode, Part
from tools.gpu_bench.row import Row, hmean, join_notes

_FLOPS_LINE = re.compile(
    r"\[metrics\] [\d.]+ GFLOP per token: 6 x ([\d,]+) matmul parameters \+ ([\d,]+) attention"
)
_SHIM_LINE = re.compile(r"\[gpu-bench compat\] torch \S+: applied (.+)")
PROFILE_FOLDER = "profile"
_KERNEL_LINE = re.compile(r"\[kernels\] (\w+): (\w+) \(([^)]*)")
_ERROR_LINE = re.compile(r"^(?:\S*\.)?(\w*(?:Error|Exception)): (.+)$", re.M)


def titan_args(part: Part, mode: Mode, dump: str, no_cuda_graphs: bool) -> list[str]:
    args = ["--module", part.module, "--config", part.tiny_config if mode.tiny else part.config]
    args += ["--training.local_batch_size", str(mode.batch), "--training.seq_len", str(mode.seq)]
    args += ["--training.steps", str(mode.steps), "--checkpoint.no-enable", "--hf.no-export"]
    args += ["--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", "--dump_folder", dump]
    args += list(part.flags)
    args += ["--profiler.enable_profiling", "--profiler.profile_freq", str(mode.profile_freq)]
    args += ["--profiler.profiler_warmup", "1", "--profiler.profiler_active", "2"]
    args += ["--profiler.save_traces_folder", PROFILE_FOLDER]
    if no_cuda_graphs:
        args.append("--training.disable_cuda_graphs")
    return [*args, "activation-checkpoint:none"]  # tyro subcommand: no activation checkpointing


def parse_titan_run(row: Row, log_text: str, status: dict, mode: Mode) -> None:
    steps = parse_step_lines(log_text)
    row.per_step_tps = [s.tokens_per_second for s in steps]
    row.losses = [s.loss for s in steps]
    steady = [s for s in steps if mode.warmup_steps < s.step <= mode.steady_last]
    if steps and len(steady) < 2:
        steady = steps[len(steps) // 2 :]
        row.note = join_notes(row.note, "few steps: steady = second half")
    if steady:
        row.tps = hmean([s.tokens_per_second for s in steady])
        row.steady_steps = f"{steady[0].step}-{steady[-1].step}"
        mfus = [s.mfu_percent for s in steady]
        row.trainer_mfu_pct = hmean(mfus) if None not in mfus else None
        memory = [s.memory_gib for s in steady if s.memory_gib is not None]
        row.logged_memory_gib = max(memory) if memory else None
    if steps and steps[0].tokens_per_second:
        row.first_step_s = round(mode.batch * mode.seq / steps[0].tokens_per_second, 2)
    match = _FLOPS_LINE.search(log_text)
    if match:
        row.flops_per_token = 6 * int(match.group(1).replace(",", "")) + int(match.group(2).replace(",", ""))
    row.shims = sorted(
        {name.strip() for m in _SHIM_LINE.finditer(log_text) for name in m.group(1).split(",")}
    )
    kernels = {m.group(1): f"{m.group(2)} ({m.group(3)})" for m in _KERNEL_LINE.finditer(log_text)}
    if kernels:
        row.extra["kernels"] = kernels
    if "Compiling each TransformerBlock" in log_text or "--compile.enable" in log_text.split("\n", 1)[0]:
        row.extra["compile"] = "per-block torch.compile"
    if "CUDA graph capture is only supported" in log_text:
        row.cuda_graphs = "n/a"
    elif "--training.disable_cuda_graphs" in log_text.split("\n", 1)[0]:
        row.cuda_graphs = "off"
    else:
        row.cuda_graphs = "on"
    if status.get("peak_allocated_gib") is not None:
        row.peak_allocated_gib = status["peak_allocated_gib"]
    if status.get("shims"):
        row.shims = sorted(set(row.shims) | set(status["shims"]))


def error_text(status: dict, log_text: str) -> str:
    if status.get("error"):
        return status["error"] + (f" @{status['where']}" if status.get("where") else "")
    found = _ERROR_LINE.findall(log_text)
    return f"{found[-1][0]}: {found[-1][1][:250]}" if found else ""


def run_titan_part(part: Part, mode: Mode, python: str, env: dict, work: str, logs: str, clock: Clock,
                   suffix: str = "", no_cuda_graphs: bool = False) -> Row:  # fmt: skip
    row = Row(part.id + suffix, part.backend, part.label + (" no-cudagraph" if suffix else ""),
              part.tiny_config if mode.tiny else part.model, anchor=part.anchor)  # fmt: skip
    cap = min(part.cap_s * mode.cap_scale, clock.left())
    status_path = os.path.join(work, f"{row.part}.status.json")
    log = os.path.join(logs, f"{row.part}.log")
    row.log = os.path.relpath(log, os.path.dirname(logs))
    args = titan_args(part, mode, os.path.join(work, "dump", row.part), no_cuda_graphs)
    say(clock, f"[{row.part}] torchtitan {' '.join(args)} (cap {cap:.0f}s, {clock.left():.0f}s left)")
    cmd = [python, "-m", "tools.gpu_bench.tt_run", "--status", status_path, "--", *args]
    rc, timed_out, seconds = run_capped(cmd, log, cap, env)
    trim_log(log)
    row.seconds = round(seconds, 1)
    with open(log, errors="replace") as f:
        text = f.read()
    status = {}
    if os.path.exists(status_path):
        with open(status_path) as f:
            status = json.load(f)
    parse_titan_run(row, text, status, mode)
    attach_profile(row, os.path.join(work, "dump", row.part))
    if "Training starts" in text and "stage" not in status:
        status["stage"] = "train"
    row.extra["stage"] = status.get("stage", "setup")
    if rc == 0 and row.tps:
        row.status = "ok"
    elif row.tps and len(row.per_step_tps) >= mode.steps:
        row.status = "partial"  # every step logged, then the process failed or hung (teardown)
        row.note = join_notes(
            row.note, f"exit {rc} after the last step" + (" (killed at cap)" if timed_out else "")
        )
    elif timed_out:
        row.status = "timeout"
        row.note = join_notes(row.note, f"killed at the {cap:.0f}s cap after {len(row.per_step_tps)} step(s)")
    else:
        row.status = "error"
        row.note = join_notes(row.note, error_text(status, text) or f"exit {rc}")
    return row


def attach_profile(row: Row, dump: str) -> None:
    """torchtitan's profiler trace of the run, summarised into ``row.extra["profile"]`` (trace kept in work)."""
    traces = sorted(glob.glob(os.path.join(dump, PROFILE_FOLDER, "iteration_*", "rank0_trace.json*")))
    if not traces:
        return
    try:
        row.extra["profile"] = trace_summary.summarise_file(traces[-1]).to_dict()
    except Exception as err:  # a damaged trace must not cost the row its figures
        row.extra["profile_error"] = f"{type(err).__name__}: {err}"


def titan_summary(row: Row, mode: Mode) -> str:
    if row.status in ("ok", "partial"):
        parts = [f"{row.tps:,.0f} tok/s (steps {row.steady_steps})"]
        if row.peak_allocated_gib is not None:
            parts.append(f"peak alloc {row.peak_allocated_gib:.2f} GiB")
        if row.logged_memory_gib is not None:
            parts.append(f"logged {row.logged_memory_gib:.2f} GiB")
        if row.first_step_s is not None:
            parts.append(f"1st step {row.first_step_s:.1f}s")
        parts.append(f"cuda graphs {row.cuda_graphs}")
        return f"[{row.part}] {row.status}: " + ", ".join(parts) + f" in {row.seconds:.0f}s"
    return f"[{row.part}] {row.status.upper()} after {row.seconds:.0f}s: {row.note}"


def retry_without_cuda_graphs(row: Row, mode: Mode) -> bool:
    """A training-time failure with CUDA graphs on is rerun once with them off (not OOM, not a timeout)."""
    return (
        mode.device == "cuda"
        and row.status == "error"
        and row.cuda_graphs == "on"
        and row.extra.get("stage") == "train"
        and "out of memory" not in row.note.lower()
    )
