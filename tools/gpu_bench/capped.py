"""Processes under a time cap, all sharing one deadline; their logs kept small enough to come back."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tools.gpu_bench.paths import ROOT


class Clock:
    def __init__(self, budget_s: float):
        self.start = time.time()
        self.deadline = self.start + budget_s

    def left(self) -> float:
        return self.deadline - time.time()

    def elapsed(self) -> float:
        return time.time() - self.start


def say(clock: Clock, message: str) -> None:
    print(f"[gpu-bench +{clock.elapsed():4.0f}s] {message}", flush=True)


def run_capped(cmd: list[str], log_path: str, cap_s: float, env: dict) -> tuple[int, bool, float]:
    """(exit code, timed out, seconds); the process gets its own session so a timeout ends all of it."""
    started = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + f"\n# cap {cap_s:.0f}s\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            return proc.wait(timeout=max(1.0, cap_s)), False, time.time() - started
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            log.write(f"\n# gpu-bench: killed after {cap_s:.0f}s (cap)\n")
            return -9, True, time.time() - started


def trim_log(path: str, limit: int = 2_000_000) -> None:
    """Keep logs small enough to come back from the device machine: head and tail of long ones."""
    size = os.path.getsize(path)
    if size <= limit:
        return
    with open(path, "rb") as f:
        head = f.read(limit // 10)
        f.seek(size - (limit - limit // 10))
        tail = f.read()
    with open(path, "wb") as f:
        f.write(head + f"\n... [{size - len(head) - len(tail):,} bytes cut] ...\n".encode() + tail)


def read_text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
