"""One-GPU training benchmark of our backends (issue 9 item 3): tok/s, TFLOP/s, MFU, peak memory.

    PYTHONPATH=packages/common/src python3 -m tools.gpu_bench.bench   # the H200 run (README.md)
    python -m tools.gpu_bench.bench --tiny       # CPU smoke test: tiny configs, seq 128
    python -m tools.gpu_bench.bench --list       # the parts, their caps, and exit

Each part is its own process under a time cap, and all of them share one deadline (``--budget``,
counted from start): a part starts only with at least its minimum left, and never runs past the
deadline. Parts, in priority order: Qwen3-1.7B (bf16 mixed precision, batch 2 x seq 4096, no
activation checkpointing) on native-backend and hf-v5-backend, compiled then eager; the
Qwen3-30B-A3B shape cut to 4 layers on nki-moe-backend's reference kernels, eager then compiled;
the same MoE shape in plain transformers (``hf_moe``). torchtitan runs go through ``tt_run``
(``torchtitan.train`` as rank 0 of a world of one) with ``--module``/``--config`` named directly:
our packages are on PYTHONPATH, not installed, so no entry point (``train``, recipe names) is used.

torchtitan rows: per-step tok/s from our step lines (``qwen3_titan_common.perf.train_log``), harmonic
mean over the steps after the warm-up ones. TFLOP/s and MFU: flops/token of our convention
(``qwen3_titan_common.perf.flops``: 6 x active matmul parameters + 12 * layers * heads * head_dim * seq,
no causal halving) x tok/s, against the device's dense bf16 peak (``perf.peaks``: 989 TFLOP/s on an
H200). Peak memory: ``torch.cuda.max_memory_allocated()`` over the run, as the anchors measured it.

Dependencies: the GPU image lacks torchtitan and its small dependencies; ``fetch_wheels.sh`` puts
them in ``<repo>/.whl``, which this script installs with ``pip --target`` into its work folder when
``torchtitan`` is not importable (``--wheels``). ``compat/`` goes first on PYTHONPATH: its
``sitecustomize`` applies the torch 2.11 polyfills before torchtitan imports and adds common's device
hook. Results: a table on stdout, and ``summary.txt``, ``gpu_bench.json`` and ``logs/`` in ``$OUT``
(else ``outputs/gpu_bench``). This module is the command line and the order of the runs; the pieces
are the package's other modules (``tools/gpu_bench/__init__.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from tools.gpu_bench.anchors import flops_check
from tools.gpu_bench.capped import Clock, say
from tools.gpu_bench.environment import child_env, install_wheels, probe_env
from tools.gpu_bench.from_common import peak_flops
from tools.gpu_bench.hf_rows import run_hf_part
from tools.gpu_bench.paths import ROOT
from tools.gpu_bench.plan import REGISTRIES, Mode, Part, select_parts
from tools.gpu_bench.report import finish_rows, write_report
from tools.gpu_bench.row import Row
from tools.gpu_bench.titan_rows import retry_without_cuda_graphs, run_titan_part, titan_summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", default=env("GPU_BENCH_TINY") == "1",
                   help="tiny configs, seq 128, on the CPU unless --device cuda (GPU_BENCH_TINY=1)")  # fmt: skip
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda, or cpu with --tiny"
    )
    p.add_argument("--budget", type=float, default=float(env("GPU_BENCH_BUDGET", 0)) or None,
                   help="seconds for all parts together (default 380; --tiny: 1800)")  # fmt: skip
    p.add_argument("--only", default=env("GPU_BENCH_ONLY", ""), help="comma-separated part ids to run")
    p.add_argument("--skip", default=env("GPU_BENCH_SKIP", ""), help="comma-separated part ids to skip")
    p.add_argument("--steps", type=int, default=None, help="torchtitan steps per run (default 15; --tiny: 5)")
    p.add_argument("--out", default=env("OUT") or os.path.join(ROOT, "outputs", "gpu_bench"))
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu_bench_work"))
    p.add_argument("--python", default=sys.executable, help="interpreter for the runs (default: this one)")
    p.add_argument("--wheels", choices=["auto", "always", "never"], default="auto",
                   help="install .whl/ into the work folder: when torchtitan is missing (auto), always, never")  # fmt: skip
    p.add_argument("--wheel-dir", default=os.path.join(ROOT, ".whl"))
    p.add_argument("--list", action="store_true", help="print the parts and exit")
    return p.parse_args(argv)


def run_parts(parts: list[Part], mode: Mode, python: str, env: dict, imports: dict, work: str, logs: str,
              clock: Clock) -> list[Row]:  # fmt: skip
    """Each part in order while time is left; a part whose imports failed is reported, not started."""
    rows: list[Row] = []
    cuda_graphs_off: set[str] = set()  # backends whose runs failed with CUDA graphs on
    for part in parts:
        blocked = ""
        if part.module:
            blocked = next((f"{m}: {e}" for m, e in imports.items()
                            if e != "ok" and m in ("torchtitan.trainer", REGISTRIES[part.backend])), "")  # fmt: skip
        left = clock.left()
        if blocked or left < part.min_s * mode.cap_scale:
            why = (
                f"not started: {blocked}"
                if blocked
                else f"not started: {left:.0f}s left < {part.min_s * mode.cap_scale:.0f}s"
            )
            rows.append(Row(part.id, part.backend, part.label, part.model, note=why, anchor=part.anchor))
            say(clock, f"[{part.id}] skipped ({why})")
            continue
        if not part.module:
            rows += run_hf_part(part, mode, python, env, work, logs, clock)
            continue
        row = run_titan_part(part, mode, python, env, work, logs, clock,
                             no_cuda_graphs=part.backend in cuda_graphs_off)  # fmt: skip
        if part.backend in cuda_graphs_off:
            row.label += " no-cudagraph"
        say(clock, titan_summary(row, mode))
        if retry_without_cuda_graphs(row, mode):
            cuda_graphs_off.add(part.backend)
            rows.append(row)
            if clock.left() >= part.min_s:
                say(clock, f"[{part.id}] failed in training with CUDA graphs on: once more without")
                row = run_titan_part(part, mode, python, env, work, logs, clock, "-nocg", True)
                say(clock, titan_summary(row, mode))
            else:
                continue
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    mode = Mode.make(opts.tiny, opts.steps, opts.device)
    budget = opts.budget or (1800.0 if mode.tiny else 380.0)
    parts = select_parts(opts)
    if opts.list:
        for p in parts:
            print(
                f"{p.id:16} cap {p.cap_s * mode.cap_scale:5.0f}s  min {p.min_s * mode.cap_scale:4.0f}s  {p.label}"
            )
        return 0
    clock = Clock(budget)
    out, work = os.path.abspath(opts.out), os.path.abspath(opts.work)
    logs = os.path.join(out, "logs")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.makedirs(logs, exist_ok=True)
    say(
        clock,
        f"mode {'tiny' if mode.tiny else 'full'} on {mode.device}; budget {budget:.0f}s; OUT {out}; python {opts.python}",
    )

    checks = flops_check(4096)
    print("== flops/token at seq 4096: ours (perf.flops) vs the anchor's (torchtitan's count) ==")
    for c in checks:
        print(f"  {c['model']:11} ours {c['ours']:,} = 6 x {c['matmul_params']:,} + {c['attention_flops']:,}; "
              f"anchor {c['anchor']:,}; {c['explanation']}")  # fmt: skip

    site_dirs, wheels_done = install_wheels(opts.python, opts.wheels, opts.wheel_dir, work, clock)
    env = child_env(mode, work, site_dirs)
    info = probe_env(opts.python, env, mode, logs, clock)
    imports = info.get("imports", {})
    say(clock, f"env: {info.get('device', '?')}, torch {info.get('versions', {}).get('torch', '?')}, "
               f"transformers {info.get('versions', {}).get('transformers', '?')}, shims needed: "
               f"{', '.join(info.get('shims_needed', [])) or 'none'}; imports: {imports or info.get('error')}")  # fmt: skip
    if mode.device == "cuda" and info.get("device_kind") != "cuda":
        say(clock, "no CUDA device: nothing to measure (use --tiny for the CPU smoke test)")
        return 2
    peak, peak_row = peak_flops(
        info.get("device_kind", mode.device),
        str(info.get("device", "")),
        titan_peak=info.get("titan_peak_flops"),
    )

    rows = run_parts(parts, mode, opts.python, env, imports, work, logs, clock)
    finish_rows(rows, mode, peak)
    write_report(rows, mode, clock, out=out, budget=budget, info=info, wheels=wheels_done, checks=checks,
                 peak=peak, peak_row=peak_row)  # fmt: skip
    return 0 if all(r.status in ("ok", "partial", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
