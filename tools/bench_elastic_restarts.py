"""Reliability loop: `train --max-restarts 1` survives a kill -9 of one worker, N times in a row.

    uv run python -m tools.bench_elastic_restarts [--runs 10] [--shared-store] [--json out.json]

Each run: the embedded default on 2 CPU ranks (gloo), checkpoints every 4 steps, 12 steps; once rank 0
logs step 10, local rank 1 (the worker, not the process tree) gets SIGKILL. torchrun must restart both
workers, which resume from step 8 and finish with exit 0; the steps run twice (9, 10) must have the
same losses before and after the restart. Reported per run: exit code, resume step, the restart's cost
(kill to the first step after the resume: shutdown, process start, init, checkpoint load) and the steps
lost (run again).

--shared-store exports TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0, which the launcher respects: torchrun then
reuses one TCPStore across restarts (torch 2.14's default), and restarted workers can read their dead
predecessors' keys: the "Gloo connectFullMesh failed ... Connection refused" (or a hang) this loop was
written to show fixed (qwen3_titan_common/launcher/elastic.py). Absolute times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from qwen3_titan_common.perf.precision import describe_cpu
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.processes import descendants, kill, torchrun_worker

STEPS, INTERVAL, KILL_AFTER = 12, 4, 10
TRAIN = str(Path(sys.executable).with_name("train"))


def one_run(workdir: Path, shared_store: bool, timeout: float) -> dict:
    env = {
        **os.environ,
        "QWEN3_TITAN_DEVICE": "cpu",
        "QWEN3_TITAN_BACKEND": "native-backend",
        "OMP_NUM_THREADS": "1",
    }
    if shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "0"
    command = [
        TRAIN, "--nproc", "2", "--max-restarts", "1", "--training.steps", str(STEPS),
        "--checkpoint.interval", str(INTERVAL), "--hf.no-export", "--debug.seed", "0", "--debug.deterministic",
        "--dump_folder", str(workdir / "out"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines, killed_at, resumed_at, first_after = [], None, None, None
    hung = threading.Event()

    def end_hung_run() -> None:  # a hung restart prints nothing: the loop below cannot notice it
        hung.set()
        kill([proc.pid, *descendants(proc.pid)])

    watchdog = threading.Timer(timeout, end_hung_run)
    watchdog.start()
    for line in proc.stdout:
        lines.append(line)
        now = time.monotonic()
        steps = parse_step_lines(line)
        if killed_at is None and any(s.step == KILL_AFTER for s in steps):
            worker = torchrun_worker(proc.pid, local_rank=1, attempt=0)
            if worker is not None:
                os.kill(worker, signal.SIGKILL)
                killed_at = now
        elif "[start] resuming from step" in line and killed_at is not None:
            resumed_at = int(line.split("[start] resuming from step")[1].split()[0])
        elif steps and resumed_at is not None and first_after is None:
            first_after = now
    code = proc.wait()
    watchdog.cancel()
    timed_out = hung.is_set()
    log = "".join(lines)
    before, _, after = log.partition("[start] resuming from step")
    first, second = {s.step: s.loss for s in parse_step_lines(before)}, parse_step_lines(after)
    same = all(abs(s.loss - first[s.step]) <= 1e-6 for s in second if s.step in first)
    ok = (
        code == 0
        and not timed_out
        and resumed_at == 2 * INTERVAL
        and [s.step for s in second] == list(range(resumed_at + 1, STEPS + 1))
        and same
    )
    return {
        "ok": ok,
        "exit_code": code,
        "timed_out": timed_out,
        "resumed_from": resumed_at,
        "restart_s": round(first_after - killed_at, 1) if first_after and killed_at else None,
        "steps_lost": KILL_AFTER - resumed_at if resumed_at is not None else None,
        "losses_equal": same,
        "gloo_connect_failed": "connectFullMesh failed" in log,
        "log_tail": "" if ok else log[-3000:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--shared-store", action="store_true", help="reproduce the failure: no fresh store")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as hung")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(describe_cpu(), flush=True)  # figures from other CPUs are not comparable as they are
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="elastic-") as tmp:
            result = one_run(Path(tmp), args.shared_store, args.timeout)
        results.append(result)
        print(
            f"run {i + 1:2d}: {'ok    ' if result['ok'] else 'FAILED'} exit {result['exit_code']}"
            f"{' (hung)' if result['timed_out'] else ''}, resumed from step {result['resumed_from']}, "
            f"restart {result['restart_s']} s, {result['steps_lost']} steps lost"
            f"{', gloo connectFullMesh failed' if result['gloo_connect_failed'] else ''}",
            flush=True,
        )
        if not result["ok"]:
            print(result["log_tail"][-1500:], flush=True)
    passed = sum(r["ok"] for r in results)
    costs = [r["restart_s"] for r in results if r["ok"] and r["restart_s"] is not None]
    store = "one TCPStore shared across restarts" if args.shared_store else "a fresh TCPStore per restart"
    print(f"\n{store}: {passed}/{args.runs} restarts succeeded")
    if costs:
        print(f"restart cost (kill to first step after the resume): median {statistics.median(costs):.1f} s, "
              f"min {min(costs):.1f} s, max {max(costs):.1f} s; steps lost: {KILL_AFTER - 2 * INTERVAL} per restart")  # fmt: skip
    if not args.shared_store:
        print(
            f"restarts succeeded (target {args.runs}/{args.runs}): {'met' if passed == args.runs else 'MISSED'}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if passed == args.runs or args.shared_store else 1


if __name__ == "__main__":
    sys.exit(main())
