"""``train --print-sbatch DEVICE``: the Slurm batch script that runs this ``train`` command on every node.

One ``srun`` task per node starts the same ``train`` (so each node runs one torchrun agent with a rank
per device); the rendezvous is torchrun's c10d store on the allocation's first node, named by the job
id; ``train`` reads the node's rank from ``SLURM_NODEID``. Requeue-friendly: the command is the same on
every (re)start and resumes from the newest complete checkpoint of its dump folder, so a job that
Slurm requeues (node failure, ``scontrol requeue``, or the time-limit trap below) carries on.

The script is text, not a template engine: a reader checks it before submitting it, and every line it
holds is one a Slurm user would write by hand. Paths resolve in ``--chdir`` (where ``--print-sbatch``
ran), which must be on storage every node sees (FSx for Lustre, /home over NFS), as must the
environment whose ``train`` the script calls.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.launcher.plan import Backend, LaunchPlan
from qwen3_titan_common.runtime.neuron_env import NEURON_ENV_DEFAULTS

RDZV_PORT = 29400  # torchrun's own default c10d port
REQUEUE_SIGNAL_LEAD_S = 300  # the time-limit warning: enough for one checkpoint of a large model


@dataclass(frozen=True)
class SbatchJob:
    backend: str  # the backend distribution, exported so that every node's `train` picks the same one
    device: str  # "neuron" | "cuda" | "cpu"
    train: str  # absolute path of the `train` executable, on shared storage
    workdir: Path  # shared directory; relative paths in the flags resolve here on every node
    plan: LaunchPlan
    nproc: int | None  # ranks per node, or None: each node's `train` counts its devices
    command: str  # the `train --print-sbatch ...` line that wrote the script

    @property
    def job_name(self) -> str:
        return f"qwen3-titan-{self.plan.config}"

    def train_args(self) -> list[str]:
        """``train``'s flags, minus what each node or the allocation decides."""
        args = ["--module", self.plan.module, "--config", self.plan.config]
        if self.nproc is not None:
            args += ["--nproc", str(self.nproc)]
        if self.plan.max_restarts:
            args += ["--max-restarts", str(self.plan.max_restarts)]
        return args + self.plan.passthrough


def _shell_value(value: str) -> str:
    """``value`` quoted for the shell, with this user's home as ``$HOME`` (the same user on every node)."""
    home = os.path.expanduser("~")
    if home != "/" and value.startswith(home + os.sep):
        return "$HOME" + shlex.quote(value[len(home) :])
    return shlex.quote(value)


def _environment(job: SbatchJob) -> list[str]:
    lines = [f"export QWEN3_TITAN_BACKEND={shlex.quote(job.backend)}"]
    if job.device == "cpu":
        lines.append("export QWEN3_TITAN_DEVICE=cpu")
    if job.device == "neuron":
        lines.append(
            "# The Neuron runtime (qwen3_titan_common/runtime/neuron_env.py); values exported before sbatch win."
        )
        lines += [f"export {k}=${{{k}:-{_shell_value(v)}}}" for k, v in NEURON_ENV_DEFAULTS.items()]
    return lines


def render_sbatch(job: SbatchJob) -> str:
    gres_hint = (
        ["# GPUs scheduled as GRES on your cluster? Add: #SBATCH --gpus-per-node=<GPUs per node>"]
        if job.device == "cuda"
        else []
    )
    train = " \\\n    ".join(
        [
            shlex.quote(job.train),
            '--nnodes "$SLURM_NNODES" --rdzv-endpoint "$head_node:$rdzv_port" --rdzv-id "$SLURM_JOB_ID"',
            shlex.join(job.train_args()),
        ]
    )
    lines = [
        "#!/bin/bash",
        f"# Written by: {job.command}",
        "# Submit: sbatch [--nodes N] [--partition P] [--time T] THIS_FILE (command-line options win over",
        "# the #SBATCH lines). Requeued or resubmitted, it resumes from the dump folder's newest checkpoint.",
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.plan.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
        f"#SBATCH --chdir={job.workdir}",
        "#SBATCH --output=slurm-%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{REQUEUE_SIGNAL_LEAD_S}",
        *gres_hint,
        "set -euo pipefail",
        "",
        *_environment(job),
        "",
        "# torchrun's c10d rendezvous, hosted by the agent on the allocation's first node for the whole job.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"rdzv_port=${{MASTER_PORT:-{RDZV_PORT}}}",
        "",
        "# With a --time limit Slurm sends USR1 shortly before it: requeue instead of ending, and resume.",
        'trap \'echo "[slurm] time limit near: requeueing job $SLURM_JOB_ID"; scontrol requeue "$SLURM_JOB_ID"\' USR1',
        "",
        'echo "[slurm] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"',
        "# One task per node, with all of the node's CPUs (a step gets one CPU per task unless told).",
        'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 \\',
        f"    {train} &",
        "wait $!",
        "",
    ]
    return "\n".join(lines)


def _train_executable() -> str:
    beside_python = Path(sys.executable).with_name("train")
    return str(beside_python) if beside_python.exists() else (shutil.which("train") or "train")


_OTHER_MODES = {"dry_run": "--dry-run", "check_layout": "--check-layout", "print_cmd": "--print-cmd"}


def print_sbatch(backend: Backend, opts: argparse.Namespace, plan: LaunchPlan, argv: list[str]) -> int:
    """The script, once the job passed the checks its ranks would run (``launcher.rehearse.check_planned_job``):
    a mistyped flag does not wait in a cluster's queue to fail."""
    from qwen3_titan_common.launcher.rehearse import check_planned_job

    for name, flag in _OTHER_MODES.items():
        if getattr(opts, name, False):
            raise UserInputError(
                f"--print-sbatch and {flag} both given: the script runs the job itself; run {flag} "
                "without --print-sbatch (or put it in the script by hand)"
            )
    check_planned_job(plan, ranks_per_node_known=opts.nproc is not None)
    job = SbatchJob(
        backend=backend.distribution,
        device=opts.print_sbatch,
        train=_train_executable(),
        workdir=Path.cwd(),
        plan=plan,
        nproc=plan.nproc_per_node if opts.nproc is not None else None,
        command=shlex.join(["train", *argv]),
    )
    print(render_sbatch(job), end="")
    return 0
