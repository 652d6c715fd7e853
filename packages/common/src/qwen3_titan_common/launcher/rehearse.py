"""Rank 0 of a planned job, rehearsed in a child process before any rank starts: ``train --dry-run``, the checks
of ``--check-layout`` and ``--print-sbatch``, and the fit check of a launch whose memory matters.

The launcher starts the rehearsal as torchrun starts a rank: ``python -m torchtitan.train`` with the job's
torchtitan flags, on torchtitan's fake process group (``--comm.mode fake_backend``: no accelerator, no other
ranks), with the ``--rehearsal`` section that has our trainer's config build rank 0's rehearsal
(``train.rehearsal``) instead of the trainer. The launcher neither parses the config nor poses as a rank: it
shows the lines the rehearsal says as it says them (``protocols.rehearsal``), and ends a refusal with the one line
the rank recorded in its torchelastic error file, as it does for a run's ranks. The rest of the child's output
(torchtitan's log) is kept back, and shown when it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Protocol

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.launcher.rank_files import recorded_message
from qwen3_titan_common.launcher.titan_flags import TitanFlags, before_subcommands
from qwen3_titan_common.protocols.rank_errors import SHOW_TRACEBACK_ENV, USER_ERROR, show_tracebacks_asked
from qwen3_titan_common.protocols.rehearsal import RehearsalReport

# Flags every rehearsal adds: rank 0 of the job on torchtitan's fake process group, nothing compiled.
REHEARSAL_FLAGS = ("--comm.mode", "fake_backend", "--compile.no-enable")
PRECISION_FLAG = "--training.mixed_precision_param"
BATCH_FLAGS = ("--training.local_batch_size", "--training.global_batch_size")
# Hugging Face weights from this size up are "real size": a launch estimates their memory before torchrun
# (about 5-30 s); smaller ones (the tests' and the embedded model) start at once.
REAL_SIZE_BYTES = 10**9
# Not passed on to the rehearsal: a rank's placement, which it sets itself from its config (one inherited would
# misplace it), and torchrun's restart count (a rank's user error would stop its parent, here the launcher).
_RANK_ENV = ("NGPU", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_MAX_RESTARTS")


class PlannedJob(Protocol):
    """What a rehearsal needs of the launcher's plan (``launcher.plan.LaunchPlan``)."""

    module: str
    config: str
    nproc_per_node: int
    nnodes: int
    device_kind: str | None  # of a job that runs here; None for a job planned for other machines
    memory_per_rank: str | None  # stated with --memory-per-rank: GiB, or a device named in perf.fit

    @property
    def world_size(self) -> int: ...

    def titan_args(self) -> list[str]: ...

    @property
    def flags(self) -> TitanFlags: ...

    def job_device_kind(self) -> str: ...


def rehearse(plan: PlannedJob, mode: str, *, nproc_per_node: int | None = None) -> dict:
    """Rank 0 of ``plan`` rehearsed in ``mode`` (``Rehearsal.Config.mode``), its lines shown as it says them:
    its result. ``nproc_per_node``: ranks per node, if not the plan's (0: the fewest its layout allows). Raises a
    one-line UserInputError for what the job's ranks would refuse, or a RehearsalFailed."""
    flags = plan.flags
    named = [
        what
        for what, given in (
            ("precision", flags.given(PRECISION_FLAG)),
            ("batch", any(flags.given(flag) for flag in BATCH_FLAGS)),
            ("recomputation", flags.names_section("--activation_checkpoint")),
        )
        if given
    ]
    scratch = Path(tempfile.mkdtemp(prefix="qwen3-titan-rehearsal-"))
    report = RehearsalReport(scratch / "report.jsonl")
    section = {
        "mode": mode,
        "report": str(report.path),
        "nnodes": plan.nnodes,
        "nproc_per_node": plan.nproc_per_node if nproc_per_node is None else nproc_per_node,
        "device_kind": plan.device_kind or "",
        "job_device": plan.job_device_kind(),
        "memory_per_rank": plan.memory_per_rank or "",
        "named": ",".join(named),
    }
    rehearsal = [
        token for key, value in section.items() if value != "" for token in (f"--rehearsal.{key}", str(value))
    ]
    command = [
        sys.executable, "-m", "torchtitan.train",
        *before_subcommands(plan.titan_args(), (*REHEARSAL_FLAGS, *rehearsal)),
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key not in _RANK_ENV}
    # The fake process group and meta tensors need no accelerator.
    env.update(
        {
            "QWEN3_TITAN_DEVICE": "cpu",
            "TORCHELASTIC_ERROR_FILE": str(scratch / "error.json"),
            SHOW_TRACEBACK_ENV: "0",
        }
    )
    try:
        with open(scratch / "output.log", "w") as output:
            code = _follow(
                subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT), report
            )
        if code == 0 and report.result is not None:
            return report.result
        recorded = recorded_message(scratch / "error.json")
        if recorded is not None and recorded.startswith(USER_ERROR):
            raise UserInputError(recorded[len(USER_ERROR) :])
        if recorded is None and code == 2:  # a config function not ours: tyro printed its own box
            raise UserInputError(
                f"--config {plan.config}: the command line did not parse (train --help lists the flags)"
            )
        raise RehearsalFailed(mode, recorded, (scratch / "output.log").read_text(errors="replace"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _follow(proc: subprocess.Popen, report: RehearsalReport) -> int:
    """Show what ``report`` says while ``proc`` runs; its exit code. An interruption stops it first."""
    try:
        while True:
            try:
                code = proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                code = None
            for said in report.read_new():
                print(said.line, file=sys.stderr if said.stderr else sys.stdout, flush=True)
            if code is not None:
                return code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class RehearsalFailed(Exception):
    """The rehearsal stopped on an internal error: what it recorded, and its output for ``--show-traceback``."""

    def __init__(self, mode: str, recorded: str | None, output: str):
        what = {"dry_run": "the dry run", "fit": "the memory check", "check": "the job's checks"}[mode]
        super().__init__(f"{what} (rank 0 rehearsed in a child process): {recorded or 'no error recorded'}")
        self.output = output


def dry_run(plan: PlannedJob) -> int:
    """``train --dry-run``: rank 0 of ``plan`` laid out and sharded after every check its ranks would run."""
    rehearse(plan, "dry_run")
    return 0


def check_planned_job(plan: PlannedJob, *, ranks_per_node_known: bool) -> None:
    """Refuses, in one line, what the job's ranks would refuse: its flags parsed and checked on this machine
    as a dry run checks them. What this machine cannot confirm (weights or data only on the cluster, its
    folders and free disk) is left to the job. Nodes that count their own devices are laid out at the fewest
    ranks per node the layout allows."""
    rehearse(plan, "check", nproc_per_node=None if ranks_per_node_known else 0)


def check_before_launch(plan: PlannedJob) -> list[str]:
    """For a job on this machine whose memory matters (Hugging Face weights of real size, where a step that does
    not fit fails after minutes of loading, or ``--memory-per-rank``): the rehearsal's fit check
    (``Rehearsal._fit``) before torchrun starts. The torchtitan arguments it settled are returned."""
    from qwen3_titan_common.perf.memory import safetensors_bytes

    flags = plan.flags
    if flags.switched_on("--hf.to_dcp"):
        return []  # a conversion trains no step
    device = plan.job_device_kind()
    if plan.nnodes > 1 or not device or (device == "cuda" and not plan.memory_per_rank):
        # A job on other nodes has its own memory; a CUDA job here is checked against --memory-per-rank only (the
        # GPUs' free memory is for its ranks to query).
        return []
    if not plan.memory_per_rank and safetensors_bytes(flags.value("--hf.model_dir")) < REAL_SIZE_BYTES:
        return []
    return list(rehearse(plan, "fit").get("titan_args", []))


def show_failure(error: RehearsalFailed) -> None:
    """A failed rehearsal's output, where tracebacks were asked for."""
    if show_tracebacks_asked():
        print(error.output, file=sys.stderr)
