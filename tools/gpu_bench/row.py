"""One row of the report: what a part measured, and the figures derived from it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    part: str
    backend: str
    label: str
    model: str
    status: str = "skipped"  # ok | partial | error | timeout | skipped
    note: str = ""
    tps: float | None = None
    flops_per_token: int | None = None
    tflops: float | None = None
    mfu_pct: float | None = None
    trainer_mfu_pct: float | None = None
    peak_allocated_gib: float | None = None
    logged_memory_gib: float | None = None  # torchtitan rows: max of the step lines (reserved / host RSS)
    first_step_s: float | None = None
    steady_steps: str = ""
    per_step_tps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    shims: list[str] = field(default_factory=list)
    cuda_graphs: str = ""
    extra: dict = field(default_factory=dict)
    anchor: str = ""
    seconds: float | None = None
    log: str = ""


def hmean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return len(values) / sum(1 / v for v in values) if values else None


def join_notes(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def finish_row(row: Row, peak: float | None) -> None:
    if row.tps and row.flops_per_token:
        row.tflops = round(row.flops_per_token * row.tps / 1e12, 4)
        if peak:
            row.mfu_pct = round(100 * row.flops_per_token * row.tps / peak, 3)
    if row.tps:
        row.tps = round(row.tps, 1)
    if row.trainer_mfu_pct is not None:
        row.trainer_mfu_pct = round(row.trainer_mfu_pct, 3)
