"""The transformers rows: one ``hf_moe`` process (eager, then per-layer compile), two rows."""

from __future__ import annotations

import json
import os
import time

from tools.gpu_bench.anchors import real_architecture
from tools.gpu_bench.capped import Clock, read_text, run_capped, say, trim_log
from tools.gpu_bench.from_common import flops_breakdown
from tools.gpu_bench.plan import Mode, Part
from tools.gpu_bench.row import Row
from tools.gpu_bench.titan_rows import error_text


def moe_flops_per_token(mode: Mode) -> int:
    if mode.tiny:  # nki-moe's debug_moe, written out by hf_moe's record
        return 0
    return flops_breakdown(real_architecture("30B-A3B x4"), mode.seq).per_token


def run_hf_part(
    part: Part, mode: Mode, python: str, env: dict, work: str, logs: str, clock: Clock
) -> list[Row]:
    cap = min(part.cap_s * mode.cap_scale, clock.left())
    results = os.path.join(work, "hf_moe.jsonl")
    log = os.path.join(logs, f"{part.id}.log")
    cmd = [python, "-m", "tools.gpu_bench.hf_moe", "--results", results, "--device", mode.device]
    cmd += ["--batch", str(mode.batch), "--seq", str(mode.seq), "--warmup", str(mode.hf_warmup)]
    cmd += ["--steps", str(mode.hf_steps), "--deadline", str(time.time() + cap - 5)]
    cmd += ["--min-phase-s", str(int(15 * mode.cap_scale)), "--phases", "eager,compile"]
    if mode.tiny:
        cmd.append("--tiny")
    say(clock, f"[{part.id}] {' '.join(cmd[2:])} (cap {cap:.0f}s, {clock.left():.0f}s left)")
    rc, timed_out, seconds = run_capped(cmd, log, cap, env)
    trim_log(log)
    records = []
    if os.path.exists(results):
        with open(results) as f:
            records = [json.loads(line) for line in f if line.strip()]
    rows = []
    for phase, anchor in (("eager", "C eager-bf16experts"), ("compile", "C compile-regional")):
        model = "debug_moe" if mode.tiny else part.model
        row = Row(f"{part.id}-{phase}", part.backend, f"{part.label} {phase}", model, anchor=anchor)
        row.log = os.path.relpath(log, os.path.dirname(logs))
        row.seconds = round(seconds, 1)
        record = next((r for r in records if r.get("phase") == phase), None)
        if record is None:
            row.status = "timeout" if timed_out else "error"
            row.note = (
                f"killed at the {cap:.0f}s cap"
                if timed_out
                else f"exit {rc}: {error_text({}, read_text(log))}"
            )
        else:
            row.status = record["status"]
            row.note = record.get("error", "")
            row.tps = record.get("tps")
            row.flops_per_token = record.get("flops_per_token") or moe_flops_per_token(mode) or None
            row.peak_allocated_gib = record.get("peak_allocated_gib")
            row.logged_memory_gib = record.get("peak_rss_gib")
            row.first_step_s = (record.get("warmup_s") or [None])[0]
            row.seconds = record.get("phase_s", row.seconds)
            row.losses = [record["final_loss"]] if "final_loss" in record else []
            row.extra = {k: record[k] for k in ("experts_impl", "params_dtype", "optimizer", "compile", "step_ms") if k in record}  # fmt: skip
        rows.append(row)
        say(clock, f"[{row.part}] {row.status}: " + (f"{row.tps:,.0f} tok/s" if row.tps else row.note))
    return rows
