"""The lent GPU's whole session in one command: CUDA correctness first, then the benchmark.

    python3 -m tools.gpu_bench.device_check [--budget 450] [--skip-tests] [bench flags after --]

From the repository root: ``-m`` puts it, and so ``tools``, on the path. This process needs nothing of
ours beyond ``tools``; each child gets every package's ``src/`` on its ``PYTHONPATH`` (our packages are
never installed on the GPU image).

1. The wheels the image lacks (``.whl/``, see README.md) go into one site folder, put on ``PYTHONPATH``
   with ``compat/`` (torch 2.11 polyfills) and every package's ``src/``: nothing is installed.
2. ``pytest -m cuda tests/test_cuda.py``: each backend's CUDA losses against the CPU's from one
   checkpoint, hf-v5's flex attention, a Qwen3-1.7B-shape export loaded by transformers on the GPU
   (in parallel with pytest-xdist when the image has it).
3. ``tools.gpu_bench.bench`` with what is left of ``--budget``: the rows, targets and a profile of each
   torchtitan row.

Everything lands in ``$OUT`` as at most 8 files (the device tool's limit): ``device_check.log``,
``cuda_tests.log``, bench's ``summary.txt``, ``gpu_bench.json`` and ``profiles.md``, and ``logs.tar.gz``
(bench's per-run logs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time

from tools.gpu_bench.capped import Clock, run_capped
from tools.gpu_bench.environment import child_env, install_wheels
from tools.gpu_bench.paths import ROOT, SRC_DIRS
from tools.gpu_bench.plan import Mode


def _log(message: str) -> None:
    print(f"[device-check +{time.time() - START:4.0f}s] {message}", flush=True)


START = time.time()


def _has_module(python: str, module: str, env: dict) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0


def run_cuda_tests(python: str, env: dict, out: str, cap_s: float) -> int:
    command = [python, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-p", "no:cacheprovider", "-rA"]
    command += ["--strict-markers", "-o", "addopts=--import-mode=importlib", "--durations=0"]
    if _has_module(python, "xdist", env):
        command += ["-n", "5"]
    log_path = os.path.join(out, "cuda_tests.log")
    _log(f"{' '.join(command[1:])} (cap {cap_s:.0f}s)")
    rc, timed_out, seconds = run_capped(command, log_path, cap_s, env)
    with open(log_path, errors="replace") as f:
        tail = f.read().splitlines()[-25:]
    _log(f"cuda tests: exit {rc}{' (killed at cap)' if timed_out else ''} in {seconds:.0f}s")
    print("\n".join(tail), flush=True)
    return rc


def pack_logs(out: str) -> None:
    logs = os.path.join(out, "logs")
    if not os.path.isdir(logs):
        return
    with tarfile.open(os.path.join(out, "logs.tar.gz"), "w:gz") as tar:
        tar.add(logs, arcname="logs")
    shutil.rmtree(logs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=450.0, help="seconds for everything (default 450)")
    p.add_argument("--tests-cap", type=float, default=170.0, help="seconds for the CUDA tests (default 170)")
    p.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "outputs", "device_check"))
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "device_check"))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then flags for tools.gpu_bench.bench")
    opts = p.parse_args(argv)
    out, work = os.path.abspath(opts.out), os.path.abspath(opts.work)
    os.makedirs(out, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    python = sys.executable
    clock = Clock(opts.budget)
    sites, done = install_wheels(python, "auto", os.path.join(ROOT, ".whl"), work, clock)
    _log(done)
    mode = Mode.make(tiny=False, steps=None, device="cuda")
    env = child_env(mode, work, sites)
    env.pop("QWEN3_TITAN_DEVICE")  # each test chooses its device
    env.update(OMP_NUM_THREADS="4", PYTEST_ADDOPTS="")
    tests_rc = 0
    if not opts.skip_tests:
        tests_rc = run_cuda_tests(python, env, out, min(opts.tests_cap, clock.left() - 60))
    bench_args = opts.bench_args[1:] if opts.bench_args[:1] == ["--"] else opts.bench_args
    budget = max(60.0, clock.left() - 15)
    command = [python, "-m", "tools.gpu_bench.bench", "--wheels", "never", "--budget", f"{budget:.0f}"]
    command += ["--out", out, "--work", os.path.join(work, "bench"), *bench_args]
    bench_path = [
        *sites,
        *SRC_DIRS,
        os.environ.get("PYTHONPATH", ""),
    ]  # the driver imports common's stdlib parts
    bench_env = {**os.environ, "PYTHONPATH": os.pathsep.join(bench_path)}
    _log(f"bench: {' '.join(command[1:])}")
    bench_rc = subprocess.run(command, env=bench_env, cwd=ROOT).returncode
    pack_logs(out)
    _log(f"done: cuda tests exit {tests_rc}, bench exit {bench_rc}")
    return 1 if tests_rc or bench_rc else 0


if __name__ == "__main__":
    sys.exit(main())
