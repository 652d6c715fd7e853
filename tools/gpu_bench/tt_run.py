"""One torchtitan training run in this process, as rank 0 of a world of one.

    python -m tools.gpu_bench.tt_run --status STATUS.json -- --module qwen3_titan_native --config qwen3_1_7b [flags]

Everything after ``--`` goes to ``torchtitan.train`` unchanged (the same as
``python -m torchtitan.train ...`` under ``torchrun --nproc_per_node=1``). Around it:

* the single-rank rendezvous variables (RANK, WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT, ...)
  are set where absent, so no torchrun agent is needed;
* the compat shims are applied (sitecustomize also does it; this covers a run without it);
* ``torch.cuda.max_memory_allocated()`` is read before each of torchtitan's per-log peak resets,
  so the run's peak *allocated* memory is known (the step lines print the reserved peak);
* the stage reached (``setup`` until ``Trainer.train`` starts, then ``train``) and the outcome
  are written to ``--status`` as JSON, and printed as one ``[tt-run]`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback

from tools.gpu_bench.compat import shims as compat_shims

GIB = 2**30


class Run:
    def __init__(self, status_path: str | None):
        self.status_path = status_path
        self.stage = "setup"
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.started = time.time()

    def record_peak(self, torch) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.peak_allocated = max(self.peak_allocated, torch.cuda.max_memory_allocated())
            self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved())

    def finish(self, **fields) -> None:
        fields.setdefault("stage", self.stage)
        fields["wall_s"] = round(time.time() - self.started, 1)
        if self.peak_allocated:
            fields["peak_allocated_gib"] = round(self.peak_allocated / GIB, 2)
            fields["peak_reserved_gib"] = round(self.peak_reserved / GIB, 2)
        print("[tt-run] " + json.dumps(fields), flush=True)
        if self.status_path:
            with open(self.status_path, "w") as f:
                json.dump(fields, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_rank_env() -> None:
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("GROUP_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _hook_memory_and_stage(run: Run, torch) -> None:
    from torchtitan.components.metrics import DeviceMemoryMonitor
    from torchtitan.trainer import Trainer

    reset = DeviceMemoryMonitor.reset_peak_stats

    def reset_peak_stats(self):
        run.record_peak(torch)
        return reset(self)

    DeviceMemoryMonitor.reset_peak_stats = reset_peak_stats
    train = Trainer.train

    def train_and_mark(self, *args, **kwargs):
        run.stage = "train"
        return train(self, *args, **kwargs)

    Trainer.train = train_and_mark


def main(argv: list[str], run: Run) -> int:
    _single_rank_env()
    import torch

    shims = compat_shims().apply()
    try:  # what an installed `common` does through its .pth file (harmless on a GPU)
        from qwen3_titan_common.runtime.device_autoload import ensure_installed

        ensure_installed()
    except ImportError:
        pass
    import torchtitan
    from torchtitan.train import main as titan_main

    print(
        f"[tt-run] torch {torch.__version__}, torchtitan {getattr(torchtitan, '__version__', '?')} "
        f"from {os.path.dirname(torchtitan.__file__)}, cuda {torch.cuda.is_available()}",
        flush=True,
    )
    _hook_memory_and_stage(run, torch)
    sys.argv = ["torchtitan.train", *argv]
    titan_main()
    run.record_peak(torch)
    run.finish(ok=True, shims=shims)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--status", default=None, help="write the outcome here as JSON")
    parser.add_argument("titan_args", nargs=argparse.REMAINDER, help="-- then torchtitan.train's flags")
    opts = parser.parse_args()
    titan_args = opts.titan_args[1:] if opts.titan_args[:1] == ["--"] else opts.titan_args
    run = Run(opts.status)
    try:
        rc = main(titan_args, run)
    except SystemExit as exit_:  # tyro's CLI errors exit; a clean exit(0) is a success
        code = exit_.code if isinstance(exit_.code, int) else 1
        if code:
            run.finish(ok=False, error=f"SystemExit({exit_.code})")
        rc = code
    except BaseException as err:  # report every failure in one line, with where it was raised
        traceback.print_exc()
        frames = traceback.extract_tb(err.__traceback__)
        where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else ""
        message = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        run.finish(ok=False, error=f"{type(err).__name__}: {message}", where=where)
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip interpreter teardown (NCCL, compile workers): the numbers are written
