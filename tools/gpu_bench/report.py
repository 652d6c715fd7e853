"""The report: the table next to the anchor, each target's verdict, and the files written to OUT."""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict

from tools.gpu_bench import trace_summary
from tools.gpu_bench.anchors import ANCHORS, TARGETS, real_architecture
from tools.gpu_bench.capped import Clock
from tools.gpu_bench.from_common import flops_breakdown
from tools.gpu_bench.plan import Mode
from tools.gpu_bench.row import Row, finish_row, join_notes


def finish_rows(rows: list[Row], mode: Mode, peak: float | None) -> None:
    """TFLOP/s and MFU of each row; a note where the trainer's flops/token or MFU disagree with ours."""
    for row in rows:
        if row.flops_per_token is None and not mode.tiny:
            row.flops_per_token = flops_breakdown(real_architecture(row.model), mode.seq).per_token
        finish_row(row, peak)
        if not mode.tiny and row.flops_per_token:
            expected = flops_breakdown(real_architecture(row.model), mode.seq).per_token
            if row.flops_per_token != expected:
                row.note = join_notes(
                    row.note, f"trainer flops/token {row.flops_per_token:,} != {expected:,}"
                )
        if row.trainer_mfu_pct is not None and row.mfu_pct and abs(row.trainer_mfu_pct - row.mfu_pct) > 0.05 * row.mfu_pct:  # fmt: skip
            row.note = join_notes(row.note, f"trainer's MFU {row.trainer_mfu_pct:.2f}% differs")


def target_verdict(row: Row) -> str:
    target = TARGETS.get(row.backend)
    if target is None or row.status not in ("ok", "partial"):
        return ""
    out = []
    if row.mfu_pct is None:
        out.append("MFU n/a")
    elif row.mfu_pct >= target.mfu_pct:
        out.append(f"MFU>={target.mfu_pct:.0f} met")
    else:
        out.append(f"MFU -{target.mfu_pct - row.mfu_pct:.1f}pp")
    if target.memory_gib is not None and row.peak_allocated_gib is not None:
        over = row.peak_allocated_gib - target.memory_gib
        out.append(f"mem<={target.memory_gib:.1f} met" if over <= 0 else f"mem +{over:.1f}GiB")
    return ", ".join(out)


def fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(rows: list[Row], mode: Mode, peak: float | None, peak_row: str) -> list[str]:
    header = (
        "row",
        "status",
        "tok/s",
        "TFLOP/s",
        "MFU%",
        "peakGiB",
        "| anchor",
        "tok/s",
        "MFU%",
        "GiB",
        "x",
        "| target",
    )
    widths = (27, 8, 9, 9, 7, 8, 23, 8, 7, 7, 6, 0)
    lines = [
        f"== {'tiny CPU smoke test' if mode.tiny else 'one GPU'}: batch {mode.batch} x seq {mode.seq}, "
        f"bf16 mixed precision, no activation checkpointing ==",
        f"MFU = flops/token (ours) x tok/s / peak ({peak_row}); peakGiB = torch.cuda.max_memory_allocated"
        + (" (CPU: peak host RSS)" if mode.device == "cpu" else ""),
        "anchor = gpu-anchor run of 2026-11-29 (tt: upstream torchtitan 0.3.0 Trainer; hf: plain transformers"
        " loop); x = our tok/s / anchor's",
        "".join(h.ljust(w) if w else h for h, w in zip(header, widths, strict=True)),
    ]
    for row in rows:
        name, a_tps, a_mfu, a_mem = ANCHORS.get(row.anchor, ("", None, None, None))
        memory = row.peak_allocated_gib if row.peak_allocated_gib is not None else row.logged_memory_gib
        ratio = row.tps / a_tps if (row.tps and a_tps and not mode.tiny) else None
        cells = (
            row.label,
            row.status,
            fmt(row.tps, ",.0f"),
            fmt(row.tflops, ".1f" if not mode.tiny else ".4f"),
            fmt(row.mfu_pct, ".2f", "n/a" if row.tps else "-"),
            fmt(memory, ".2f"),
            f"| {name}",
            fmt(a_tps, ",.0f"),
            fmt(a_mfu, ".2f"),
            fmt(a_mem, ".2f"),
            fmt(ratio, ".2f"),
            "| " + (target_verdict(row) or (row.note[:90] if row.status not in ("ok", "partial") else "")),
        )
        lines.append("".join(c.ljust(w) if w else c for c, w in zip(cells, widths, strict=True)).rstrip())
    return lines


def targets_summary(rows: list[Row]) -> tuple[list[str], list[dict]]:
    lines, records = ["== targets (issue 9): each backend's best row =="], []
    for backend, target in TARGETS.items():
        done = [r for r in rows if r.backend == backend and r.status in ("ok", "partial") and r.tps]
        record: dict = {
            "backend": backend,
            "mfu_target_pct": target.mfu_pct,
            "memory_target_gib": target.memory_gib,
        }
        if not done:
            lines.append(f"{backend:16} no completed row: target not measured")
            record["verdict"] = "not measured"
            records.append(record)
            continue
        best = max(done, key=lambda r: (r.mfu_pct or 0, r.tps))
        record.update(best_row=best.label, mfu_pct=best.mfu_pct, peak_allocated_gib=best.peak_allocated_gib)
        if best.mfu_pct is None:
            mfu = f"MFU n/a on this device (target >= {target.mfu_pct:.0f}%)"
            record["mfu_verdict"] = "n/a"
        elif best.mfu_pct >= target.mfu_pct:
            mfu = f"MFU {best.mfu_pct:.2f}% >= {target.mfu_pct:.0f}%: MET"
            record["mfu_verdict"] = "met"
        else:
            short = target.mfu_pct - best.mfu_pct
            mfu = f"MFU {best.mfu_pct:.2f}% < {target.mfu_pct:.0f}%: MISSED by {short:.2f} pp"
            mfu += f" ({100 * short / target.mfu_pct:.0f}% short)"
            record["mfu_verdict"] = f"missed by {short:.2f} pp"
        mem = ""
        if target.memory_gib is not None:
            if best.peak_allocated_gib is None:
                mem = f"; memory n/a (target <= {target.memory_gib:.2f} GiB, anchor {target.memory_anchor})"
                record["memory_verdict"] = "n/a"
            elif best.peak_allocated_gib <= target.memory_gib:
                mem = f"; memory {best.peak_allocated_gib:.2f} <= {target.memory_gib:.2f} GiB: MET"
                record["memory_verdict"] = "met"
            else:
                over = best.peak_allocated_gib - target.memory_gib
                mem = f"; memory {best.peak_allocated_gib:.2f} > {target.memory_gib:.2f} GiB: MISSED by {over:.2f} GiB"
                record["memory_verdict"] = f"missed by {over:.2f} GiB"
        lines.append(f"{backend:16} best: {best.label}: {mfu}{mem}")
        records.append(record)
    return lines, records


def profile_report(rows: list[Row]) -> list[str]:
    lines = ["## Profiles (torchtitan's profiler, the last two steps before the final one)", ""]
    for row in rows:
        found = row.extra.get("profile")
        if found:
            summary = trace_summary.TraceSummary(**{k: v for k, v in found.items() if k != "busy_pct"})
            lines += [*trace_summary.markdown(f"{row.label} ({row.model})", summary), ""]
        elif row.extra.get("profile_error"):
            lines += [f"#### {row.label}: profile unreadable: {row.extra['profile_error']}", ""]
    return lines


def write_report(rows: list[Row], mode: Mode, clock: Clock, *, out: str, budget: float, info: dict, wheels: str,
                 checks: list[dict], peak: float | None, peak_row: str | None) -> None:  # fmt: skip
    """The report on stdout and in ``summary.txt``; ``profiles.md``; everything in ``gpu_bench.json``."""
    lines = table(rows, mode, peak, peak_row or "n/a")
    target_lines, target_records = targets_summary(rows)
    shims_applied = sorted({s for r in rows for s in r.shims})
    env_line = (
        f"env: {info.get('device', '?')} | torch {info.get('versions', {}).get('torch', '?')} | transformers "
        f"{info.get('versions', {}).get('transformers', '?')} | torchtitan {info.get('versions', {}).get('torchtitan', '?')}"
        + (f" | bf16 8192^3 matmul {info['bf16_matmul_8192_tflops']} TFLOP/s" if "bf16_matmul_8192_tflops" in info else "")
        + f" | shims applied: {', '.join(shims_applied) or 'none'}"
    )  # fmt: skip
    notes = [f"  {r.label}: {r.note}" for r in rows if r.note and r.status in ("ok", "partial")]
    report = [
        "",
        env_line,
        *lines,
        *(["notes:", *notes] if notes else []),
        *target_lines,
        f"total wall {clock.elapsed():.0f}s of a {budget:.0f}s budget; logs and gpu_bench.json in {out}",
    ]
    print("\n".join(report), flush=True)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(report).lstrip("\n") + "\n")
    with open(os.path.join(out, "profiles.md"), "w") as f:
        f.write("\n".join(profile_report(rows)) + "\n")
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "tiny" if mode.tiny else "full",
        "shape": {"batch": mode.batch, "seq": mode.seq, "steps": mode.steps, "steady_after": mode.warmup_steps},
        "device": info.get("device"),
        "versions": info.get("versions"),
        "env": info,
        "wheels": wheels,
        "shims_needed": info.get("shims_needed"),
        "shims_applied": shims_applied,
        "peak_flops": peak,
        "peak_source": peak_row,
        "flops_check": checks,
        "rows": [asdict(r) for r in rows],
        "targets": target_records,
        "anchors": {k: dict(zip(("what", "tps", "mfu_pct", "peak_allocated_gib"), v, strict=True)) for k, v in ANCHORS.items()},
        "budget_s": budget,
        "wall_s": round(clock.elapsed(), 1),
    }  # fmt: skip
    with open(os.path.join(out, "gpu_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if all(r.status in ("ok", "partial", "skipped") for r in rows) else 1
