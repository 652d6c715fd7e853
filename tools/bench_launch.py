"""Benchmark: launch to first step of the default run, this checkout against an earlier revision.

    uv run python tools/bench_launch.py [--baseline REV] [--pairs N] [--json FILE]

The default run is the README's first command, ``uv run --package native-backend train`` (here
``train`` with ``QWEN3_TITAN_BACKEND=native-backend``, the same backend chosen without uv in between), cut to one step and writing into a
temporary folder (``--training.steps 1 --dump_folder DIR``): what it does before its first step (the
launcher's checks, torchrun, each rank's imports, config, HF weights, data, the first step itself) is what
a newcomer waits for. The time is from starting ``train`` to its first step line on stdout.

The baseline is a git worktree of ``REV`` (default ``f20a55e``, the revision before the launcher's channels
and layout were reworked) with its own environment (``uv sync --locked``, from uv's cache). The two sides run
in interleaved pairs in this one run, alternating which goes first, so that load on the machine falls on
both alike; the table gives every pair, each side's median, and the median of the pairs' ratios. Target: the
checkout no slower than the baseline (ratio at most 1 + the pairs' own spread).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = "f20a55e"


def worktree_train(rev: str, where: Path) -> Path:
    """``train`` of a fresh worktree of ``rev`` with its own locked environment."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev], check=True)
    subprocess.run(["uv", "sync", "--locked", "--quiet"], cwd=where, check=True)
    return where / ".venv" / "bin" / "train"


def first_step_seconds(train: Path, work: Path) -> float:
    """Seconds from starting ``train`` (one step, into ``work``) to its first step line."""
    from qwen3_titan_common.perf.train_log import parse_step_lines

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {
        "QWEN3_TITAN_BACKEND": "native-backend"
    }
    start = time.perf_counter()
    proc = subprocess.Popen(
        [str(train), "--training.steps", "1", "--dump_folder", str(work / "out")],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen, tail = None, []
    for line in proc.stdout:
        tail = [*tail[-40:], line]
        if seen is None and parse_step_lines(line):
            seen = time.perf_counter() - start
    if proc.wait() != 0 or seen is None:
        raise RuntimeError(f"{train} failed ({proc.returncode}):\n{''.join(tail)}")
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the git revision to compare with")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs of runs (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="write the pairs here too")
    opts = parser.parse_args()
    here = Path(sys.executable).with_name("train")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            baseline = worktree_train(opts.baseline, tmp / "baseline")
            print(f"| pair | first | this checkout s | baseline {opts.baseline} s | ratio |")
            print("|---|---|---|---|---|")
            pairs = []
            for pair in range(opts.pairs):
                order = [("checkout", here), ("baseline", baseline)]
                if pair % 2:
                    order.reverse()
                seconds = {name: first_step_seconds(train, tmp / "work") for name, train in order}
                pairs.append(seconds)
                print(
                    f"| {pair + 1} | {order[0][0]} | {seconds['checkout']:.1f} | {seconds['baseline']:.1f} "
                    f"| {seconds['checkout'] / seconds['baseline']:.3f} |",
                    flush=True,
                )
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "baseline")])
    ratios = [p["checkout"] / p["baseline"] for p in pairs]
    median = {side: statistics.median(p[side] for p in pairs) for side in ("checkout", "baseline")}
    print(
        f"medians: this checkout {median['checkout']:.1f} s, baseline {median['baseline']:.1f} s; "
        f"median ratio {statistics.median(ratios):.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f})"
    )
    if opts.json:
        opts.json.write_text(json.dumps({"baseline": opts.baseline, "pairs": pairs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
