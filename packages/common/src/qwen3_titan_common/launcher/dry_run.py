"""``train --dry-run``: rank 0 of a planned job in this process, checking a layout of any size on the CPU.

torchtitan's fake process group ("fake_backend" comm mode) lets rank 0 of an N-rank
job build its device meshes, shard the model (FSDP2 / TP / EP as the backend's
parallelize function does) and report what it would hold, with no accelerator and
no weights: the model stays on the meta device, so a 4B or 30B shape costs nothing.

Before that, the run's config is parsed as a rank parses it and goes through the checks every rank
runs first (``Qwen3Trainer.resolved_and_checked``): a dry run refuses what the run would refuse. A job planned
for other machines lists what it could not confirm on this one (weights not downloaded here, this disk's free
space).
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Protocol

from qwen3_titan_common.errors import UserInputError, first_line
from qwen3_titan_common.launcher.titan_flags import TitanFlags, before_subcommands
from qwen3_titan_common.models.layout import LayoutError, resolve_layout

# Flags a dry run adds: rank 0 of the job on torchtitan's fake process group, nothing compiled.
DRY_RUN_FLAGS = ("--comm.mode", "fake_backend", "--compile.no-enable")

GIB = 1024**3


class PlannedJob(Protocol):
    """What a dry run needs of the launcher's plan (``launcher.plan.PlannedJob``)."""

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


def fake_rank_env(plan: PlannedJob) -> None:
    """Rank 0 of the planned job, on torchtitan's fake process group; set before the config is parsed."""
    os.environ.update(
        {
            "NGPU": str(plan.world_size),
            "WORLD_SIZE": str(plan.world_size),
            "LOCAL_WORLD_SIZE": str(plan.nproc_per_node),
            "RANK": "0",
            "LOCAL_RANK": "0",
            # The fake process group and meta tensors need no accelerator.
            "QWEN3_TITAN_DEVICE": "cpu",
        }
    )


def parse_run_config(plan: PlannedJob, extra_flags: tuple[str, ...] = ()) -> Any:
    """torchtitan's config for this launch, parsed as a rank parses it; a rejected flag is one line (the config
    function has torchtitan's parser raise it, ``rank_errors.record_refused_flags``). Warnings printed while
    parsing are the ranks' to print, so they are dropped here.
    """
    from qwen3_titan_common.runtime.device_autoload import ensure_installed

    ensure_installed()
    from torchtitan.config import ConfigManager

    captured = io.StringIO()
    try:
        with redirect_stdout(captured), redirect_stderr(captured):
            return ConfigManager().parse_args(before_subcommands(plan.titan_args(), extra_flags))
    except UserInputError:
        raise
    except SystemExit:  # a config function not ours: tyro printed its own box
        raise UserInputError(
            f"--config {plan.config}: the command line did not parse (train --help lists the flags)"
        ) from None
    except Exception as err:  # a config function or torchtitan's validation rejected a value
        raise UserInputError(f"--config {plan.config} with these flags: {first_line(err)}") from None


# Ranks per node tried for a job whose nodes count their own devices: the checks lay it out at the smallest
# count its parallel degrees allow; a count the cluster's nodes cannot give fails there.
_NODE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def check_planned_job(plan: PlannedJob, *, ranks_per_node_known: bool) -> None:
    """Refuses, in one line, what the job's ranks would refuse: its flags parsed and checked on this machine
    as a dry run checks them. What this machine cannot confirm (weights or data only on the cluster, its
    folders and free disk) is left to the job."""
    planned = plan
    if not ranks_per_node_known:
        parallelism = parse_run_config(plan).parallelism
        sizes = [n for n in _NODE_SIZES if _lays_out(parallelism, n * plan.nnodes)] or [_NODE_SIZES[-1]]
        planned = dataclasses.replace(plan, nproc_per_node=sizes[0])
    fake_rank_env(planned)
    checked_config(planned)


def _lays_out(parallelism, world_size: int) -> bool:
    try:
        resolve_layout(parallelism, world_size)
    except LayoutError:
        return False
    return True


def checked_config(plan: PlannedJob) -> tuple[Any, list[str]]:
    """The run's config as rank 0 of ``plan`` resolves and checks it (``Qwen3Trainer.resolved_and_checked``, after
    :func:`fake_rank_env`), and what this machine could not confirm: a model directory that is not here
    is listed, and the config's built-in architecture laid out instead. Raises a one-line UserInputError."""
    from qwen3_titan_common.errors import CheckpointError
    from qwen3_titan_common.train.trainer import Qwen3Trainer

    parsed = parse_run_config(plan, DRY_RUN_FLAGS)
    if not isinstance(parsed, Qwen3Trainer.Config):
        return parsed, []  # another package's config (--module): its own trainer checks it
    pending: list[str] = []
    quiet = io.StringIO()  # the checks' log lines are the ranks' to print
    model_dir = parsed.hf.model_dir
    try:
        with redirect_stdout(quiet), redirect_stderr(quiet):
            return Qwen3Trainer.resolved_and_checked(parsed, deferred=pending)[1], pending
    except CheckpointError as err:
        if not model_dir or Path(model_dir).expanduser().exists():
            raise
        pending.append(str(err))
    without = dataclasses.replace(parsed, hf=dataclasses.replace(parsed.hf, model_dir=None))
    with redirect_stdout(quiet), redirect_stderr(quiet):
        return Qwen3Trainer.resolved_and_checked(without, deferred=pending)[1], pending


PRECISION_FLAG = "--training.mixed_precision_param"


def dry_run(plan: PlannedJob) -> int:
    """Lay out and shard rank 0 of ``plan`` after every check its ranks would run."""
    from qwen3_titan_common.perf.memory import local_numel
    from qwen3_titan_common.train.memory_check import (
        does_not_fit,
        estimate_rank0,
        estimated_capacity_factor,
        fit_line,
        job_device_kind,
        rank_memory_of,
    )

    job_device = job_device_kind(plan)  # before the fake rank's environment names the CPU
    fake_rank_env(plan)
    config, pending = checked_config(plan)
    import torch
    import torch.distributed as dist

    try:
        layout = resolve_layout(config.parallelism, plan.world_size)
    except LayoutError as err:
        raise UserInputError(str(err)) from None
    print(f"[dry-run] layout: {layout.describe()}")
    from qwen3_titan_common.perf.precision import default_compute_precision, precision_line

    # The dry run lays the job out on this machine's CPU. A job planned for another device kind
    # (--memory-per-rank trn2|h100|h200) computes in that device's default precision unless the command names one;
    # a job here in this CPU's.
    named = plan.flags.given(PRECISION_FLAG)
    planned = job_device if job_device in ("neuron", "cuda") else "cpu"
    default = default_compute_precision(planned)
    if planned != "cpu" and not named:
        training = dataclasses.replace(config.training, mixed_precision_param=default.dtype)
        config = dataclasses.replace(config, training=training)
    asked = config.training.mixed_precision_param
    other = (
        "; another device's: --training.mixed_precision_param"
        if asked == default.dtype and planned == "cpu"
        else ""
    )
    print(f"[dry-run] precision: {precision_line(asked, planned, default)}{other}")

    try:
        job, estimate = estimate_rank0(plan, config, job_device)
        with torch.device("meta"):
            total = sum(p.numel() for p in job.spec.model.build().parameters())
        if job.parallel_dims.pp_enabled:
            print(
                "[dry-run] pipeline parallel: sharding per stage is not simulated; totals below are unsharded"
            )
        model = job.sharded_model(config.activation_checkpoint)
        params = sum(local_numel(p) for p in model.parameters())
        trainable = sum(local_numel(p) for p in model.parameters() if p.requires_grad)
        del model
        trained = "" if trainable == params else f" ({trainable:,} of them trainable: LoRA adapters)"
        print(
            f"[dry-run] model {plan.module}:{plan.config}: {total:,} parameters, {params:,} on rank 0{trained}"
        )
        compute = "bf16" if config.training.mixed_precision_param == "bfloat16" else "fp32"
        how = (
            "torch's memory tracker over a fake step, steady state"
            if estimate.tracked
            else "a rule of thumb: fake tensors cannot run this layout's data-dependent token routing"
        )
        if estimate.extrapolated_from is not None:
            (low, high), layers = estimate.extrapolated_from
            how += f"; its first {low} and {high} layers tracked, extrapolated per layer to its {layers}"
        capacity = estimated_capacity_factor(config)
        if capacity is not None and estimate.tracked:
            how += f", the expert exchange at {capacity:g}x a balanced load per expert"
        print(
            f"[dry-run] memory per rank at the step's peak (batch {config.training.local_batch_size} x seq "
            f"{config.training.seq_len}, {compute} compute, {how}), GiB: {estimate.describe()}"
        )
        memory = rank_memory_of(plan, plan.device_kind)
        fits = True
        if memory is not None:
            said, line = fit_line(plan, estimate, memory)
            fits = said != "does not fit"
            if fits:
                print(f"[dry-run] memory {said}: {line}")
            else:
                print(f"train: {does_not_fit(job, estimate, line, memory, plan.nnodes)}", file=sys.stderr)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    ranks = f"{plan.world_size} ranks ({plan.nnodes} node(s) x {plan.nproc_per_node})"
    if not fits:
        return 2
    if pending:
        for note in pending:
            print(f"[dry-run] not on this machine: {note}")
        print(f"[dry-run] layout ok: {ranks}; the run needs what is listed above first")
    else:
        print(f"[dry-run] ok: {ranks}")
    sys.stdout.flush()
    return 0


@contextmanager
def as_fake_rank(plan: PlannedJob):
    """This process as rank 0 of ``plan`` on torchtitan's fake process group, and as it was afterwards."""
    import torch.distributed as dist

    saved = dict(os.environ)
    fake_rank_env(plan)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


RECOMPUTE = "activation-checkpoint:full"


def check_before_launch(plan: PlannedJob) -> list[str]:
    """For a job on this machine whose memory matters (Hugging Face weights of real size, where a step that does
    not fit fails after minutes of loading, or ``--memory-per-rank``): the estimate against a rank's memory, in
    one line, before torchrun starts. Refuses a job that does not fit (UserInputError, with what fits); a run
    that names no batch gets the largest that fits, up to its config's; one whose batch fits only with its
    activations recomputed, and that chooses no activation checkpointing, gets ``activation-checkpoint:full``.
    The torchtitan arguments that set either are returned."""
    from qwen3_titan_common.perf.memory import safetensors_bytes
    from qwen3_titan_common.train.memory_check import (
        BATCH_FLAGS,
        REAL_SIZE_BYTES,
        does_not_fit,
        estimate_rank0,
        fit_line,
        job_device_kind,
        largest_fitting_batch,
        rank_memory_of,
        with_full_recomputation,
    )

    flags = plan.flags
    if flags.switched_on("--hf.to_dcp"):
        return []  # a conversion trains no step
    device = job_device_kind(plan)
    if plan.nnodes > 1 or not device or (device == "cuda" and not plan.memory_per_rank):
        return []  # a CUDA memory query would hold a CUDA context in the launcher for the whole run
    if not plan.memory_per_rank and safetensors_bytes(flags.value("--hf.model_dir")) < REAL_SIZE_BYTES:
        return []
    with as_fake_rank(plan):
        config, _ = checked_config(plan)
        job, estimate = estimate_rank0(plan, config, device)
        memory = rank_memory_of(plan, device)
        if memory is None:
            return []
        said, line = fit_line(plan, estimate, memory)
        if said != "does not fit":
            print(f"[train] memory {said}: {line}", file=sys.stderr)
            return []
        fitting = None
        if not any(flags.given(flag) for flag in BATCH_FLAGS):
            fitting = largest_fitting_batch(job, estimate, memory)
        if fitting is None and not flags.names_section("--activation_checkpoint"):
            recomputed = with_full_recomputation(job, estimate)
            if recomputed is not None and recomputed.total_bytes <= memory.bytes_per_rank:
                _, fitted = fit_line(plan, recomputed, memory)
                print(
                    f"[train] memory: activation-checkpoint:full (the batch of {config.training.local_batch_size} "
                    f"does not fit without recomputing activations in the backward), {fitted}; "
                    "activation-checkpoint:none or :selective as the last argument sets it",
                    file=sys.stderr,
                )
                return [RECOMPUTE]
        if fitting is None:
            raise UserInputError(does_not_fit(job, estimate, line, memory, plan.nnodes))
        batch, tried = fitting
        _, fitted = fit_line(plan, tried, memory)
        print(
            f"[train] memory: batch {batch} per rank (the config's {config.training.local_batch_size} does not "
            f"fit), {fitted}; --batch-size sets it",
            file=sys.stderr,
        )
        return ["--training.local_batch_size", str(batch)]
