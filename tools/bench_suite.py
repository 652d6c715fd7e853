"""The benchmark suite: every CPU benchmark in one process sequence, one table, one JSON file.

    uv run python -m tools.bench_suite [--quick] [--json bench.json]     # or: uv run python tools/bench_suite.py

Runs, one after another on this machine (never in parallel, so they do not share cores):
  bench_native_cpu.py  native-backend vs a plain transformers Qwen3ForCausalLM loop; launch to first step
  bench_hf_v5_cpu.py   hf-v5-backend vs native-backend vs a plain transformers loop
  bench_moe_cpu.py     nki-moe-backend reference kernels vs transformers' eager Qwen3-MoE, model and layer
  bench_hf_io.py       HF checkpoint load/export vs raw safetensors, with peak RSS
  bench_data.py        the data pipeline's batch rate vs the debug model's consumption
  bench_eval.py        validation's share of a debug run's wall time; eval's tokens/s vs training's
  bench_cpu_precision.py  the default's compute precision vs fp32, on this CPU and without its bf16 instructions
Each script prints its own figures with medians and spread; this collects every line that states a
target (`... (target ...): met|MISSED`) into one table and writes all outputs to JSON. Absolute times
depend on the machine and its load; only the ratios are meant to be compared. No test asserts on them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from qwen3_titan_common.perf.precision import describe_cpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SUITE = [
    (
        "native vs transformers, launch time",
        "bench_native_cpu.py",
        ["--repeats", "3"],
        ["--repeats", "1", "--steps", "12"],
    ),
    (
        "hf-v5 vs native vs transformers",
        "bench_hf_v5_cpu.py",
        ["--repeats", "3"],
        ["--repeats", "1", "--steps", "12"],
    ),
    ("nki-moe reference vs transformers MoE", "bench_moe_cpu.py", [], ["--steps", "4"]),
    (
        "HF load/export vs safetensors",
        "bench_hf_io.py",
        ["--repeats", "3"],
        ["--repeats", "1", "--size-gb", "0.25"],
    ),
    ("data pipeline vs model", "bench_data.py", [], ["--batches", "50"]),
    ("validation cost, eval vs training", "bench_eval.py", ["--repeats", "3"], ["--repeats", "1"]),
    ("packed chats vs one per row vs TRL", "bench_packing.py", [], ["--quick"]),
    (
        "default precision vs fp32, with and without bf16 instructions",
        "bench_cpu_precision.py",
        [],
        ["--pairs", "1"],
    ),
]
_TARGET = re.compile(r"target|: (met|MISSED)\b", re.IGNORECASE)


def run_one(script: str, args: list[str]) -> dict:
    start = time.perf_counter()
    # Each as a module from the repository root: some import their shared helpers as tools.bench_*.
    module = f"tools.{Path(script).stem}"
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT)
    return {
        "script": script,
        "args": args,
        "returncode": proc.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "stdout": proc.stdout,
        "stderr_tail": proc.stderr[-4000:],
        "targets": [line.strip() for line in proc.stdout.splitlines() if _TARGET.search(line)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps (a smoke run)")
    parser.add_argument("--json", type=Path, default=Path("bench_suite.json"))
    parser.add_argument(
        "--only", action="append", default=None, help="run only scripts whose name contains this"
    )
    args = parser.parse_args()
    cpu = describe_cpu()
    print(cpu, flush=True)  # figures from other CPUs are not comparable as they are
    results = []
    for title, script, full, quick in SUITE:
        if args.only and not any(o in script for o in args.only):
            continue
        if not (HERE / script).exists():
            results.append(
                {"title": title, "script": script, "returncode": None, "targets": [], "missing": True}
            )
            continue
        print(f"[suite] {title}: {script} ...", flush=True)
        result = run_one(script, quick if args.quick else full)
        result["title"] = title
        results.append(result)
    print(f"\n{cpu}\n\n| benchmark | seconds | status | figures against targets |\n|---|---|---|---|")
    for r in results:
        status = (
            "missing" if r.get("missing") else ("ok" if r["returncode"] == 0 else f"exit {r['returncode']}")
        )
        targets = "<br>".join(r["targets"]) or "(no target lines; see JSON)"
        print(f"| {r['title']} | {r.get('seconds', '-')} | {status} | {targets} |")
    args.json.write_text(
        json.dumps({"date": time.strftime("%Y-%m-%d"), "cpu": cpu, "results": results}, indent=2)
    )
    print(f"\nall outputs: {args.json}")
    return 0 if all(r.get("returncode") in (0, None) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
