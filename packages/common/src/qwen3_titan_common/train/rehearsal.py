"""Rank 0 of a planned job, rehearsed on torchtitan's fake process group: what ``train --dry-run``, the checks of
``--check-layout`` and ``--print-sbatch``, and a launch's fit check run, in a process of their own.

The launcher starts it as torchrun starts a rank, through torchtitan's own entry (``-m torchtitan.train``) with the
job's flags, ``--comm.mode fake_backend`` and a ``--rehearsal`` section naming what to rehearse
(``launcher.rehearse``). torchtitan builds the trainer its config names; our trainer's config builds a
:class:`Rehearsal` instead when ``--rehearsal.mode`` is set (``Qwen3Trainer.Config.build``), and torchtitan calls its
``train`` and ``close`` as it would the trainer's. The fake process group lets rank 0 of an N-rank job build its
device meshes, shard the model (FSDP2 / TP / EP as the backend's parallelize function does) and report what it
would hold, with no accelerator and no weights: the model stays on the meta device, so a 4B or 30B shape costs
nothing.

First the run's config goes through the checks every rank runs (``Qwen3Trainer.resolved_and_checked``): a
rehearsal refuses what the run would refuse, as the run refuses it (its torchelastic error file). A job planned
for other machines lists what it could not confirm on this one (weights not downloaded here, this disk's free
space). What the user reads, and what the launcher acts on, go to the report file (``protocols.rehearsal``); the
rehearsal writes nothing else.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchtitan.config import Configurable

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.models.layout import LayoutError, resolve_layout
from qwen3_titan_common.protocols.rehearsal import RehearsalReport
from qwen3_titan_common.train.memory_check import (
    does_not_fit,
    estimate_rank0,
    estimated_capacity_factor,
    fit_line,
    largest_fitting_batch,
    rank_memory_of,
    with_full_recomputation,
)

# Ranks per node tried for a job whose nodes count their own devices: the checks lay it out at the smallest
# count its parallel degrees allow; a count the cluster's nodes cannot give fails there.
_NODE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
RECOMPUTE = "activation-checkpoint:full"


def rank0_environment(world_size: int, nproc_per_node: int) -> dict[str, str]:
    """The environment torchrun gives rank 0 of a job of ``world_size`` ranks, ``nproc_per_node`` on each node, and
    the NGPU that torchtitan's fake process group reads its size from."""
    world = str(world_size)
    return {
        "NGPU": world,
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "RANK": "0",
        "LOCAL_RANK": "0",
    }


class Rehearsal(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """Set by the ``train`` launcher when it rehearses a job (``launcher.rehearse``); empty in a real run."""

        mode: Literal["", "check", "dry_run", "fit"] = ""
        """What to rehearse. check: the job's checks, and its layout and batch as rank 0 resolves them; dry_run:
        that, laid out and sharded, with its memory estimate; fit: the estimate against a rank's memory before a
        launch, and the settings that fit. Empty: train."""
        report: str = ""
        """The file the rehearsal says its lines and its result in (``protocols.rehearsal.RehearsalReport``)."""
        nnodes: int = 1
        nproc_per_node: int = 0
        """Ranks per node of the planned job; 0: the fewest its parallel degrees lay out (nodes that count
        their own devices, ``--print-sbatch`` without ``--nproc``)."""
        device_kind: str = ""
        """The kind of this machine's devices, for a job that runs on them; empty for a job planned for others."""
        job_device: str = ""
        """The kind of device the job's ranks run on ('' where unknown): ``--memory-per-rank``'s, or this
        machine's for a one-node job."""
        memory_per_rank: str = ""
        """``--memory-per-rank``: GiB, or a device named in ``perf.fit``; empty: this machine's devices'."""
        named: str = ""
        """Which settings the command line names, comma-separated: ``precision``, ``batch`` (the per-rank batch),
        ``recomputation`` (an activation checkpointing subcommand). What the user named is kept as named."""

        @property
        def world_size(self) -> int:
            return self.nnodes * self.nproc_per_node

        def names(self, setting: str) -> bool:
            return setting in self.named.split(",")

    def __init__(self, config: Config, *, trainer_config: Any, trainer: type):
        if not config.report or trainer_config.comm.mode != "fake_backend":
            # Set by hand, it would lay the job out on real process groups and say nothing.
            raise UserInputError(
                f"--rehearsal.mode {config.mode}: the train launcher sets it, with the rehearsal's --rehearsal.report "
                "and --comm.mode fake_backend; run train --dry-run instead"
            )
        self.config = config
        self.trainer_config = trainer_config
        self.trainer = trainer  # the class the config would build, whose checks a rank runs
        self.report = RehearsalReport(Path(config.report))

    def train(self) -> None:
        """Rehearse the job; a refusal raises a one-line UserInputError, recorded as a rank's is."""
        from qwen3_titan_common.protocols.rank_errors import rank_errors

        with rank_errors(lambda: self.trainer_config):
            if self.config.nproc_per_node == 0:
                self.config = dataclasses.replace(self.config, nproc_per_node=self._fewest_ranks_per_node())
            os.environ.update(rank0_environment(self.config.world_size, self.config.nproc_per_node))
            {"check": self._check, "dry_run": self._dry_run, "fit": self._fit}[self.config.mode]()

    def close(self) -> None:
        pass

    def _fewest_ranks_per_node(self) -> int:
        parallelism = self.trainer_config.parallelism
        for size in _NODE_SIZES:
            try:
                resolve_layout(parallelism, size * self.config.nnodes)
            except LayoutError:
                continue
            return size
        return _NODE_SIZES[-1]

    def _check(self) -> None:
        config, _ = checked_config(self.trainer_config, self.trainer)
        layout = resolve_layout(config.parallelism, self.config.world_size)
        training = config.training
        self.report.found(
            layout=dataclasses.asdict(layout),
            local_batch=training.local_batch_size,
            global_batch=training.global_batch_size,
            seq_len=training.seq_len,
            layers=config.architecture.num_hidden_layers if config.architecture is not None else None,
        )

    def _dry_run(self) -> None:
        """Lay out and shard rank 0 after every check its ranks would run, and say what it holds."""
        import torch

        from qwen3_titan_common.perf.memory import local_numel
        from qwen3_titan_common.perf.precision import default_compute_precision, precision_line

        plan, say = self.config, self.report.say
        config, pending = checked_config(self.trainer_config, self.trainer)
        layout = resolve_layout(config.parallelism, plan.world_size)  # checked already (check_run)
        say(f"[dry-run] layout: {layout.describe()}")
        # The dry run lays the job out on this machine's CPU. A job planned for another device kind
        # (--memory-per-rank trn2|h100|h200) computes in that device's default precision unless the command names
        # one; a job here in this CPU's.
        planned = plan.job_device if plan.job_device in ("neuron", "cuda") else "cpu"
        default = default_compute_precision(planned)
        if planned != "cpu" and not plan.names("precision"):
            training = dataclasses.replace(config.training, mixed_precision_param=default.dtype)
            config = dataclasses.replace(config, training=training)
        asked = config.training.mixed_precision_param
        other = (
            "; another device's: --training.mixed_precision_param"
            if asked == default.dtype and planned == "cpu"
            else ""
        )
        say(f"[dry-run] precision: {precision_line(asked, planned, default)}{other}")

        job, estimate = estimate_rank0(plan, config, plan.job_device)
        with torch.device("meta"):
            total = sum(p.numel() for p in job.spec.model.build().parameters())
        if job.parallel_dims.pp_enabled:
            say(
                "[dry-run] pipeline parallel: sharding per stage is not simulated; totals below are unsharded"
            )
        model = job.sharded_model(config.activation_checkpoint)
        params = sum(local_numel(p) for p in model.parameters())
        trainable = sum(local_numel(p) for p in model.parameters() if p.requires_grad)
        del model
        trained = "" if trainable == params else f" ({trainable:,} of them trainable: LoRA adapters)"
        module, name = config.config_function or ("", "")
        say(f"[dry-run] model {module}:{name}: {total:,} parameters, {params:,} on rank 0{trained}")
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
        say(
            f"[dry-run] memory per rank at the step's peak (batch {config.training.local_batch_size} x seq "
            f"{config.training.seq_len}, {compute} compute, {how}), GiB: {estimate.describe()}"
        )
        memory = rank_memory_of(plan, plan.device_kind)
        if memory is not None:
            said, line = fit_line(plan, estimate, memory)
            if said == "does not fit":
                raise UserInputError(
                    does_not_fit(job, estimate, line, memory, plan.nnodes, runs=self._runs_with(config))
                )
            say(f"[dry-run] memory {said}: {line}")
        ranks = f"{plan.world_size} ranks ({plan.nnodes} node(s) x {plan.nproc_per_node})"
        for note in pending:
            say(f"[dry-run] not on this machine: {note}")
        if pending:
            say(f"[dry-run] layout ok: {ranks}; the run needs what is listed above first")
        else:
            say(f"[dry-run] ok: {ranks}")
        self.report.found()

    def _runs_with(self, config) -> Callable[[str], bool]:
        """Whether the job runs with twice its degree of a ``--parallelism`` field: what LoRA, a tied model's
        pipeline stages and the backend (its ``check_parallelism``) refuse, for the advice of a job that fits
        nowhere."""
        from qwen3_titan_common.train.lora import check_lora_layout

        def runs(field: str) -> bool:
            parallelism = dataclasses.replace(
                config.parallelism, **{field: 2 * getattr(config.parallelism, field)}
            )
            if field == "pipeline_parallel_degree" and self.trainer.trains_tied_embeddings(config):
                return False  # the first and last stages cannot share one weight (train.preflight)
            try:
                if config.lora.enabled:
                    check_lora_layout(parallelism)
                self.trainer.check_parallelism(dataclasses.replace(config, parallelism=parallelism))
            except UserInputError:
                return False
            return True

        return runs

    def _fit(self) -> None:
        """For a job on this machine whose memory matters (the launcher asks for real-size weights, where a step
        that does not fit fails after minutes of loading, or for ``--memory-per-rank``): the estimate against a
        rank's memory, in one line, before torchrun starts. Refuses a job that does not fit, saying what fits; a
        run that names no batch gets the largest that fits, up to its config's; one whose batch fits only with
        its activations recomputed, and that chooses no activation checkpointing, gets
        ``activation-checkpoint:full``. The result is the torchtitan arguments that set either."""
        plan, say = self.config, self.report.say
        config, _ = checked_config(self.trainer_config, self.trainer)
        job, estimate = estimate_rank0(plan, config, plan.job_device)
        memory = rank_memory_of(plan, plan.job_device)
        if memory is None:
            return self.report.found(titan_args=[])
        said, line = fit_line(plan, estimate, memory)
        if said != "does not fit":
            say(f"[train] memory {said}: {line}", stderr=True)
            return self.report.found(titan_args=[])
        fitting = None if plan.names("batch") else largest_fitting_batch(job, estimate, memory)
        if fitting is None and not plan.names("recomputation"):
            recomputed = with_full_recomputation(job, estimate)
            if recomputed is not None and recomputed.total_bytes <= memory.bytes_per_rank:
                _, fitted = fit_line(plan, recomputed, memory)
                say(
                    f"[train] memory: {RECOMPUTE} (the batch of {config.training.local_batch_size} does not fit "
                    f"without recomputing activations in the backward), {fitted}; activation-checkpoint:none or "
                    ":selective as the last argument sets it",
                    stderr=True,
                )
                return self.report.found(titan_args=[RECOMPUTE])
        if fitting is None:
            raise UserInputError(
                does_not_fit(job, estimate, line, memory, plan.nnodes, runs=self._runs_with(config))
            )
        batch, tried = fitting
        _, fitted = fit_line(plan, tried, memory)
        say(
            f"[train] memory: batch {batch} per rank (the config's {config.training.local_batch_size} does not "
            f"fit), {fitted}; --batch-size sets it",
            stderr=True,
        )
        self.report.found(titan_args=["--training.local_batch_size", str(batch)])


def checked_config(parsed: Any, trainer: type) -> tuple[Any, list[str]]:
    """The run's config as rank 0 resolves and checks it (``trainer.resolved_and_checked``, ``trainer`` being
    ``Qwen3Trainer`` or a backend's; this process rank 0 of the job already), and what this machine could not
    confirm: a model directory that is not here is listed, and the config's built-in architecture laid out
    instead. Raises a one-line UserInputError."""
    from qwen3_titan_common.errors import CheckpointError

    pending: list[str] = []
    model_dir = parsed.hf.model_dir
    try:
        return trainer.resolved_and_checked(parsed, deferred=pending)[1], pending
    except CheckpointError as err:
        if not model_dir or Path(model_dir).expanduser().exists():
            raise
        pending.append(str(err))
    without = dataclasses.replace(parsed, hf=dataclasses.replace(parsed.hf, model_dir=None))
    return trainer.resolved_and_checked(without, deferred=pending)[1], pending
