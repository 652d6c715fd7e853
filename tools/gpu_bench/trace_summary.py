"""Where the GPU time of a profiled torchtitan step goes, from torchtitan's own profiler trace.

    python -m tools.gpu_bench.trace_summary DUMP/profile/iteration_17/rank0_trace.json.gz

torchtitan's ``--profiler.enable_profiling`` writes a Chrome trace (torch.profiler's Kineto export) of
the last ``--profiler.profiler_active`` steps before each ``--profiler.profile_freq``-th step. This reads
its device kernels (``"cat": "kernel"``, also those replayed from a CUDA graph), sorts each into one
category by name, and reports per step: milliseconds per category, the device's busy time (the union of
kernel intervals) against the profiled steps' wall time, and the heaviest kernels. Standard library
only, so the benchmark driver (which never imports torch) can run it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from dataclasses import asdict, dataclass, field

# First match wins: attention before GEMM (cuDNN/flash kernels carry GEMM-like names), the optimizer
# before generic elementwise work.
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn|cudnn_generated", re.I)),
    ("grouped GEMM (experts)", re.compile(r"grouped|group_gemm|GroupProblemShape", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|\bsm\d+_", re.I)),
    ("optimizer (AdamW)", re.compile(r"adam|multi_tensor_apply", re.I)),
    ("NCCL", re.compile(r"nccl", re.I)),
    ("compiled (triton)", re.compile(r"^triton_", re.I)),
    ("cross-entropy / softmax (eager)", re.compile(r"softmax|nll_loss|cross_entropy|logsumexp", re.I)),
    ("reductions (eager)", re.compile(r"reduce_kernel|norm_kernel|sum_kernel|max_kernel", re.I)),
    (
        "sort / scatter / index (MoE routing)",
        re.compile(r"sort|scatter|gather|index|histc|cumsum|topk|radix", re.I),
    ),
    ("copies and casts", re.compile(r"copy|cast|chunk_cat|split_with_sizes|cat_|CatArray|fill", re.I)),
    ("elementwise (eager)", re.compile(r"elementwise|vectorized|unrolled", re.I)),
    ("memcpy / memset", re.compile(r"^Mem(cpy|set)", re.I)),
)
OTHER = "other"
_STEP_EVENT = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass
class TraceSummary:
    steps: list[int]
    wall_ms_per_step: float
    busy_ms_per_step: float
    kernel_ms_per_step: float
    kernels_per_step: float
    by_category_ms: dict[str, float]
    top_kernels: list[tuple[str, float, int]] = field(default_factory=list)  # name, ms/step, count/step

    @property
    def busy_pct(self) -> float:
        return 100 * self.busy_ms_per_step / self.wall_ms_per_step if self.wall_ms_per_step else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "busy_pct": round(self.busy_pct, 1)}


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return OTHER


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarise(events: list[dict], top: int = 12) -> TraceSummary:
    spans: dict[int, tuple[float, float]] = {}
    for e in events:
        match = _STEP_EVENT.match(str(e.get("name", "")))
        if match and e.get("ph") == "X" and not str(e.get("cat", "")).startswith("gpu"):
            # torch.profiler's ProfilerStep#k runs torchtitan's training step k + 1 (its step_num starts at
            # the step the run starts from, before that step's first call). A step can be recorded on
            # several host threads: its span is their union.
            step, start = int(match.group(1)) + 1, float(e["ts"])
            end = start + float(e.get("dur", 0))
            old = spans.get(step, (start, end))
            spans[step] = (min(old[0], start), max(old[1], end))
    steps = [(step, start, end) for step, (start, end) in sorted(spans.items())]
    kernels = [
        e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"
    ]
    if steps:
        # The profiled steps' wall time: from the first step's start to the later of the last step's
        # end and its last kernel (the device may still be working when the host step ends).
        begin = min(s[1] for s in steps)
        host_end = max(s[2] for s in steps)
        kernels = [k for k in kernels if float(k["ts"]) >= begin]
        device_end = max((float(k["ts"]) + float(k.get("dur", 0)) for k in kernels), default=host_end)
        wall_us = max(host_end, device_end) - begin
    else:
        starts = [float(k["ts"]) for k in kernels]
        wall_us = (
            (max(float(k["ts"]) + float(k.get("dur", 0)) for k in kernels) - min(starts)) if kernels else 0
        )
    count = max(1, len(steps))
    by_category: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    intervals = []
    for k in kernels:
        start, dur = float(k["ts"]), float(k.get("dur", 0))
        intervals.append((start, start + dur))
        name = str(k.get("name", ""))
        label = "memcpy / memset" if k.get("cat") != "kernel" else category(name)
        by_category[label] = by_category.get(label, 0.0) + dur
        by_name.setdefault(name, []).append(dur)
    heaviest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return TraceSummary(
        steps=sorted(s[0] for s in steps),
        wall_ms_per_step=round(wall_us / 1000 / count, 3),
        busy_ms_per_step=round(_union_us(intervals) / 1000 / count, 3),
        kernel_ms_per_step=round(sum(stop - start for start, stop in intervals) / 1000 / count, 3),
        kernels_per_step=round(len(kernels) / count, 1),
        by_category_ms={
            k: round(v / 1000 / count, 3) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])
        },
        top_kernels=[
            (n[:120], round(sum(d) / 1000 / count, 3), round(len(d) / count, 1)) for n, d in heaviest
        ],
    )


def summarise_file(path: str, top: int = 12) -> TraceSummary:
    return summarise(_load(path), top)


def markdown(title: str, s: TraceSummary) -> list[str]:
    lines = [
        f"#### {title}",
        "",
        f"Profiled steps {', '.join(map(str, s.steps)) or '?'}: {s.wall_ms_per_step:.1f} ms wall per step, device busy "
        f"{s.busy_ms_per_step:.1f} ms ({s.busy_pct:.0f}%), {s.kernels_per_step:.0f} kernels per step.",
        "",
        "| category | ms/step | % of wall |",
        "|---|---|---|",
    ]
    for label, ms in s.by_category_ms.items():
        lines.append(
            f"| {label} | {ms:.2f} | {100 * ms / s.wall_ms_per_step if s.wall_ms_per_step else 0:.1f} |"
        )
    idle = s.wall_ms_per_step - s.busy_ms_per_step
    lines.append(
        f"| device idle | {idle:.2f} | {100 * idle / s.wall_ms_per_step if s.wall_ms_per_step else 0:.1f} |"
    )
    lines += ["", "| heaviest kernels | ms/step | calls/step |", "|---|---|---|"]
    lines += [f"| `{name[:90]}` | {ms:.2f} | {calls:g} |" for name, ms, calls in s.top_kernels]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a Chrome trace (.json or .json.gz) written by torch.profiler")
    p.add_argument("--top", type=int, default=12, help="heaviest kernels to list")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    opts = p.parse_args(argv)
    summary = summarise_file(opts.trace, opts.top)
    print(json.dumps(summary.to_dict(), indent=1) if opts.json else "\n".join(markdown(opts.trace, summary)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
