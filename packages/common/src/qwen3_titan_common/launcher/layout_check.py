"""``train --check-layout``: the planned parallel layout beside one rank, at 2 layers, before a long job.

Runs the job as planned (every rank on this machine: ``--nnodes`` folded into ``--nproc``) and one rank,
both at ``--debug.layers 2`` (the model's width, vocabulary and tokenizer, its first 2 decoder layers, random
weights from one seed, which ``models.layout_init`` makes the same in every layout), for 3 steps in fp32 on the
same global batch (one rank takes it in micro-batches of the layout's local batch), writing only to a
temporary folder it removes. Then one line: the largest difference of the two runs' step losses against the
bound derived from the computation (``train.tolerance``: 2k - 1 forward chains of the model for step k), ok or
not; exit 0 or 1. A layout that trains other numbers than one rank (a dropped token over an expert's capacity,
a reduction on the wrong group) shows here in a minute rather than after a day.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from qwen3_titan_common.launcher.rehearse import PlannedJob, rehearse
from qwen3_titan_common.models.layout import Layout
from qwen3_titan_common.protocols.summary import RunSummary

CHECK_LAYERS = 2
CHECK_STEPS = 3
# Both runs: the reduced model (``--debug.layers``, at most CHECK_LAYERS), a few logged steps in fp32 from one
# seed, nothing kept; given after the job's own flags, these win over them (its export, checkpoint and logging
# flags are accepted and change nothing here).
FIXED = [
    "--training.steps", str(CHECK_STEPS), "--training.mixed_precision_param", "float32", "--debug.seed", "0",
    "--metrics.log_freq", "1", "--checkpoint.no-enable", "--validator.no-enable",
]  # fmt: skip
# The one-rank run: every parallel degree 1 (given last, these win over the job's own flags).
ONE_RANK = [
    "--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "-1",
    "--parallelism.tensor_parallel_degree", "1", "--parallelism.context_parallel_degree", "1",
    "--parallelism.pipeline_parallel_degree", "1", "--parallelism.expert_parallel_degree", "1",
    "--moe.capacity_factor", "None",
]  # fmt: skip

RunJob = Callable[[PlannedJob], tuple[int, RunSummary | None]]


@dataclasses.dataclass(frozen=True)
class LayoutCheck:
    layout: Layout
    local_batch: int
    global_batch: int
    seq_len: int
    layers: int  # the model's own depth

    @classmethod
    def of(cls, plan: PlannedJob) -> LayoutCheck:
        """The job's layout and batch as its rank 0 resolves them (rehearsed: a job the run would refuse is
        refused here, before anything starts)."""
        found = rehearse(plan, "check")
        layout = Layout(**found["layout"])
        local = found["local_batch"]
        dp = layout.dp_replicate * layout.dp_shard
        global_batch = found["global_batch"]
        return cls(
            layout=layout,
            local_batch=local,
            global_batch=global_batch if global_batch > 0 else local * dp,
            seq_len=found["seq_len"],
            layers=found["layers"],
        )

    @property
    def depth(self) -> int:
        """Decoder layers the check trains: CHECK_LAYERS, or the model's own depth where it has fewer."""
        return min(CHECK_LAYERS, self.layers)

    def jobs(self, plan, folder: Path) -> dict[str, PlannedJob]:
        """The two runs: the layout (every rank on this machine) and one rank (its export gives the bound),
        both writing only below ``folder`` whatever folders the job's own flags name."""
        reduced = ["--debug.layers", str(self.depth), *FIXED]
        here = {
            "nnodes": 1,
            "node_rank": 0,
            "rdzv_endpoint": "localhost:0",
            "max_restarts": 0,
            "rdzv_id": None,
        }
        layout = dataclasses.replace(
            plan,
            nproc_per_node=plan.world_size,
            passthrough=[
                *plan.passthrough,
                *reduced,
                "--hf.no-export",
                "--dump_folder",
                str(folder / "layout"),
            ],
            **here,
        )
        batch = ["--training.local_batch_size", str(self.local_batch)]
        batch += ["--training.global_batch_size", str(self.global_batch)]
        one_rank = dataclasses.replace(
            plan,
            nproc_per_node=1,
            passthrough=[
                *plan.passthrough,
                *reduced,
                *ONE_RANK,
                *batch,
                "--dump_folder",
                str(folder / "one-rank"),
                # Its export gives the bound: written, and below the check's folder, even where the job writes
                # none (--hf.no-export) or writes its own elsewhere (--hf.export_dir).
                "--hf.export",
                "--hf.export_dir",
                str(folder / "one-rank" / "hf"),
            ],
            **here,
        )
        return {"layout": layout, "one rank": one_rank}

    def verdict(self, layout: RunSummary, one_rank: RunSummary) -> tuple[bool, str]:
        """Whether every step's loss of the layout is within the derived bound of one rank's, in one line."""
        from qwen3_titan_common.train.tolerance import ModelBounds

        # A LoRA run's export is its adapter; the bound is its model's, whose final norm and output projection
        # (all the bound reads) the adapters leave as they are in the base.
        bounds = ModelBounds.from_dir(one_rank.merged or one_rank.base or one_rank.export)
        worst = None
        for (step, expected), (_, loss) in zip(one_rank.losses or (), layout.losses or (), strict=True):
            step = int(step)
            bound = bounds.loss_atol(
                expected, tokens=self.global_batch * self.seq_len, seq_len=self.seq_len, passes=2 * step - 1
            )
            ratio = abs(loss - expected) / bound
            if worst is None or ratio > worst[0]:
                worst = (ratio, step, abs(loss - expected), bound)
        what = (
            f"{self.layout.describe()} against 1 rank ({self.depth} of the model's {self.layers} layers, "
            f"{CHECK_STEPS} steps, global batch {self.global_batch} x {self.seq_len})"
        )
        if worst is None:
            return False, f"{what}: no step losses to compare"
        ratio, step, diff, bound = worst
        dropped = layout.dropped_share or 0.0
        ok = ratio <= 1 and dropped == 0
        if dropped:
            # Each dropped assignment is an expert output one rank computes and the layout does not: other numbers,
            # whether or not the few steps' losses show it yet.
            verdict = (
                f"NOT ok: the layout's fixed-capacity expert exchange dropped {100 * dropped:.1f}% of the routed "
                "assignments over capacity, which one rank computes; --moe.capacity_factor E/top_k (or more) drops "
                "none (docs/parallelism.md)"
            )
        else:
            verdict = (
                "ok" if ok else "NOT ok: this layout trains other numbers than one rank (docs/parallelism.md)"
            )
        return ok, f"{what}: largest loss difference {diff:.2e} at step {step}, bound {bound:.2e}: {verdict}"


def how_it_runs(ranks: int, nnodes: int) -> str:
    """How the check runs a job's ranks, said before it starts them: all on this machine, one process each
    (``--nnodes`` folded into ``--nproc``), and what that costs where they outnumber its cores."""
    cores = os.cpu_count() or 1
    folded = f" (the job's {nnodes} nodes folded onto this one)" if nnodes > 1 else ""
    line = f"the layout's {ranks} ranks all run on this machine{folded}, one process each, beside 1 rank"
    if ranks > cores:
        line += (
            f"; {ranks} processes on {cores} CPU cores take turns, so each step waits for the slowest: expect "
            "minutes rather than seconds"
        )
    return line


def check_layout(plan, run_job: RunJob) -> int:
    """Run both jobs with ``run_job`` (the launcher's torchrun), print the verdict; 0 when ok, 1 when not,
    or the failing run's exit code."""
    check = LayoutCheck.of(plan)
    print(f"[check] {how_it_runs(plan.world_size, plan.nnodes)}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="qwen3-titan-check-layout-"))
    try:
        summaries = {}
        for name, job in check.jobs(plan, folder).items():
            print(
                f"[check] {name}: {job.world_size} rank(s), {check.depth} layers, {CHECK_STEPS} steps",
                flush=True,
            )
            code, summary = run_job(job)
            if code != 0:
                return code
            if summary is None or not summary.losses:
                print(f"[check] {name}: the run left no step losses to compare", flush=True)
                return 1
            summaries[name] = summary
        ok, line = check.verdict(summaries["layout"], summaries["one rank"])
        print(f"[check] {line}", flush=True)
        return 0 if ok else 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
