"""``train --dry-run``: rank 0 of a planned job in this process, checking a layout of any size on the CPU.

torchtitan's fake process group ("fake_backend" comm mode) lets rank 0 of an N-rank
job build its device meshes, shard the model (FSDP2 / TP / EP as the backend's
parallelize function does) and report what it would hold, with no accelerator and
no weights: the model stays on the meta device, so a 4B or 30B shape costs nothing.

Before that, the run's config is parsed as a rank parses it and goes through the checks every rank
runs first (``Qwen3Trainer.checked``): a dry run refuses what the run would refuse. A job planned for other machines
lists what it could not confirm on this one (weights not downloaded here, this disk's free space).
"""

from __future__ import annotations

import dataclasses
import io
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from qwen3_titan_common.errors import UserInputError, first_line
from qwen3_titan_common.train.layout import LayoutError, resolve_layout
from qwen3_titan_common.train.rank_errors import parser_message

# Flags a dry run adds: rank 0 of the job on torchtitan's fake process group, nothing compiled.
DRY_RUN_FLAGS = ("--comm.mode", "fake_backend", "--compile.no-enable")

GIB = 1024**3


class PlannedJob(Protocol):
    """What a dry run needs of the launcher's plan (``cli.plan.PlannedJob``)."""

    module: str
    config: str
    nproc_per_node: int
    nnodes: int

    @property
    def world_size(self) -> int: ...

    def titan_args(self) -> list[str]: ...


@dataclass(frozen=True)
class MemoryEstimate:
    params_per_rank: int
    trainable_per_rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # the decoder layers' and the output's (logits, their fp32 copy and gradient)

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def _local_numel(param) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return param.to_local().numel()
    return param.numel()


def _activation_bytes(config, layout, model_config) -> int:
    # Per layer, per token, about 34 * hidden bytes of bf16 activations (twice that in fp32) are kept for
    # backward without recomputation (Korthikanti et al. 2022, attention scores not
    # materialised by SDPA); selective/full recomputation keeps far less. A rough
    # upper bound for planning, not a measurement.
    # The architecture (config.json) where the config has one, as every backend's does: not every
    # backend's model config is torchtitan's Decoder.Config (hf-v5-backend's is not).
    arch = getattr(config, "architecture", None)
    hidden = arch.hidden_size if arch is not None else model_config.dim
    layers = arch.num_hidden_layers if arch is not None else len(model_config.layers)
    tokens = config.training.local_batch_size * config.training.seq_len
    per_layer = 34 * hidden * tokens // (layout.tp * layout.cp)
    if config.training.mixed_precision_param == "float32":
        per_layer *= 2
    if config.activation_checkpoint is not None:
        per_layer //= 4
    # The output at the model's vocabulary, which no recomputation shrinks: the logits in the compute
    # precision, the loss's fp32 copy of them and their fp32 gradient (a 151,936-token vocabulary makes this
    # the largest term at short sequences).
    vocab = arch.vocab_size if arch is not None else model_config.vocab_size
    compute_bytes = 4 if config.training.mixed_precision_param == "float32" else 2
    output = tokens * vocab * (compute_bytes + 4 + 4) // layout.tp
    return per_layer * layers + output


def _estimate(model, config, layout, model_config) -> MemoryEstimate:
    numel = sum(_local_numel(p) for p in model.parameters())
    # Gradients and optimizer state only for what trains (a LoRA run: the adapters).
    trainable = sum(_local_numel(p) for p in model.parameters() if p.requires_grad)
    fp32 = 4
    return MemoryEstimate(
        params_per_rank=numel,
        trainable_per_rank=trainable,
        param_bytes=numel * fp32,
        grad_bytes=trainable * fp32,
        optimizer_bytes=2 * trainable * fp32,  # AdamW: two fp32 moments
        activation_bytes=_activation_bytes(config, layout, model_config),
    )


def _fits_here(plan: PlannedJob, config, estimate: MemoryEstimate) -> bool:
    """For a job on this machine (no --nproc): the estimate against a rank's memory here, in one line;
    False, with the largest batch that would fit, when it does not fit."""
    from qwen3_titan_common.perf.fit import largest_batch, rank_memory, verdict

    kind = getattr(plan, "device_kind", None)
    memory = rank_memory(kind, plan.nproc_per_node) if kind else None
    if memory is None:
        return True
    needed = estimate.total_bytes
    said = verdict(needed, memory)
    line = f"~{needed / GIB:.2f} GiB per rank estimated, {memory.bytes_per_rank / GIB:.1f} GiB per rank here ({memory.described})"
    if said != "does not fit":
        print(f"[dry-run] memory {said}: {line}")
        return True
    batch = config.training.local_batch_size
    fits = largest_batch(needed - estimate.activation_bytes, estimate.activation_bytes, batch, memory)
    hint = (
        f"--training.local_batch_size (--batch-size) {fits} fits by the same estimate"
        if fits >= 1
        else "no batch fits by the same estimate: shard over more ranks (--nproc, --nnodes) or train LoRA adapters"
    )
    print(
        f"train: --training.local_batch_size {batch} (--batch-size) x --training.seq_len "
        f"{config.training.seq_len}: does not fit, {line}; {hint}",
        file=sys.stderr,
    )
    return False


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
    """torchtitan's config for this launch, parsed as a rank parses it; a rejected flag is one line.

    torchtitan's parser (tyro) prints its errors as a box on stderr and exits; that text is kept
    from the terminal and its message becomes the UserInputError. Warnings printed while parsing are
    the ranks' to print, so they are dropped here.
    """
    from qwen3_titan_common.runtime.device_autoload import ensure_installed

    ensure_installed()
    from torchtitan.config import ConfigManager

    captured = io.StringIO()
    try:
        with redirect_stdout(captured), redirect_stderr(captured):
            return ConfigManager().parse_args([*plan.titan_args(), *extra_flags])
    except UserInputError:
        raise
    except SystemExit:
        text = captured.getvalue()
        message = parser_message(text, plan.titan_args())
        raise UserInputError(
            message or "the command line did not parse (run with --help for the flags)"
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
    """The run's config as rank 0 of ``plan`` resolves and checks it (``Qwen3Trainer.checked``, after
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
            return Qwen3Trainer.checked(parsed, deferred=pending)[1], pending
    except CheckpointError as err:
        if not model_dir or Path(model_dir).expanduser().exists():
            raise
        pending.append(str(err))
    without = dataclasses.replace(parsed, hf=dataclasses.replace(parsed.hf, model_dir=None))
    with redirect_stdout(quiet), redirect_stderr(quiet):
        return Qwen3Trainer.checked(without, deferred=pending)[1], pending


def dry_run(plan: PlannedJob) -> int:
    """Lay out and shard rank 0 of ``plan`` after every check its ranks would run."""
    fake_rank_env(plan)
    config, pending = checked_config(plan)
    import torch
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    try:
        layout = resolve_layout(config.parallelism, plan.world_size)
    except LayoutError as err:
        raise UserInputError(str(err)) from None
    print(f"[dry-run] layout: {layout.describe()}")
    from qwen3_titan_common.perf.precision import default_compute_precision, precision_line

    # The dry run lays the job out on this machine's CPU, so the default is this CPU's; a job for
    # another device kind is planned with its precision named on the command line.
    asked, default = config.training.mixed_precision_param, default_compute_precision("cpu")
    other = "; another device's: --training.mixed_precision_param" if asked == default.dtype else ""
    print(f"[dry-run] precision: {precision_line(asked, 'cpu', default)}{other}")

    dist_utils.init_distributed(config.comm)
    parallel_dims = ParallelDims.from_config(config.parallelism, plan.world_size)
    parallel_dims.build_mesh()

    spec = config.model_spec
    model_config = spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    total = sum(p.numel() for p in model.parameters())
    if parallel_dims.pp_enabled:
        print("[dry-run] pipeline parallel: sharding per stage is not simulated; totals below are unsharded")
    else:
        model = spec.parallelize_fn(
            model,
            parallel_dims=parallel_dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=config.activation_checkpoint,
            dump_folder=config.dump_folder,
        )
    if getattr(model, "enable_weight_tying", False):
        # As torchtitan's init_states does: sharding replaced the tied parameter.
        model.tok_embeddings.weight = model.lm_head.weight
    estimate = _estimate(model, config, layout, model_config)
    trained = (
        ""
        if estimate.trainable_per_rank == estimate.params_per_rank
        else (f" ({estimate.trainable_per_rank:,} of them trainable: LoRA adapters)")
    )
    print(
        f"[dry-run] model {plan.module}:{plan.config}: {total:,} parameters, "
        f"{estimate.params_per_rank:,} on rank 0{trained}"
    )
    print(
        "[dry-run] memory per rank (fp32 params + grads + AdamW, "
        f"{'bf16' if config.training.mixed_precision_param == 'bfloat16' else 'fp32'} activations, estimate): "
        f"params {estimate.param_bytes / GIB:.2f} GiB, grads {estimate.grad_bytes / GIB:.2f} GiB, "
        f"optimizer {estimate.optimizer_bytes / GIB:.2f} GiB, activations ~{estimate.activation_bytes / GIB:.2f} GiB"
        f" (batch {config.training.local_batch_size} x seq {config.training.seq_len}); "
        f"total ~{estimate.total_bytes / GIB:.2f} GiB"
    )
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    ranks = f"{plan.world_size} ranks ({plan.nnodes} node(s) x {plan.nproc_per_node})"
    if not _fits_here(plan, config, estimate):
        return 2
    if pending:
        for note in pending:
            print(f"[dry-run] not on this machine: {note}")
        print(f"[dry-run] layout ok: {ranks}; the run needs what is listed above first")
    else:
        print(f"[dry-run] ok: {ranks}")
    sys.stdout.flush()
    return 0
