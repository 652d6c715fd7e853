"""Pipeline parallelism for the transformers model: its decoder layers split into stages over the ``pp`` ranks.

torchtitan's ``pipeline_llm`` splits a model by its top-level children (``tok_embeddings``, ``layers``,
``norm``, ``lm_head``) and sizes the split from ``model_config.layers``. ``HFCausalLM`` keeps transformers'
nesting (``model.embed_tokens``, ``model.layers.N``, ``model.norm``, ``lm_head``) so that its parameter names
are the checkpoint's, so the split is made here, the same way:

* the stages: one per ``pp`` rank for a single-stage schedule (``1F1B``, ``GPipe``), two per rank for a looped
  one, or as many as ``--parallelism.pipeline_parallel_layers_per_stage`` makes, as torchtitan counts them;
* the layers: in order, the embedding counted as ``--parallelism.pipeline_parallel_first_stage_less_layers``
  layers in the first stage and the final norm with ``lm_head`` as ``..._last_stage_less_layers`` in the last;
* a stage's model is a copy of the meta model keeping its own modules under their names
  (``HFCausalLM.as_pipeline_stage``), so checkpoints, the export and ``models.layout_init`` see one model's
  names across the stages;
* each stage is parallelised as a whole model is (``parallelize_fn``: TP, AC, compile, FSDP2), and the
  schedule is torch's, built as torchtitan builds it (micro-batches of
  ``--parallelism.pipeline_parallel_microbatch_size``, gradients not scaled: the loss is divided by the global
  token count).

A tied model is refused before launch (``train.preflight``: its first and last stages cannot share the weight),
and so are a Qwen3-MoE directory and torchtitan's module lists per stage (``parallelize.check_parallelism``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from qwen3_titan_common.errors import UserInputError
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from torchtitan.tools.logging import logger

# Schedules that run a rank's two stages as a V: the first and the last, the second and the one before, ...
V_SCHEDULES = (ScheduleZBVZeroBubble, ScheduleDualPipeV)


def stage_layers(
    num_layers: int, num_stages: int, *, first_stage_less: int = 1, last_stage_less: int = 1
) -> list[range]:
    """The decoder layers of each stage: ``num_layers`` plus the embedding's and the output's weights, dealt in
    order as evenly as they go (the earlier stages take the remainder)."""
    units = num_layers + first_stage_less + last_stage_less
    if num_stages > units:
        raise UserInputError(
            f"--parallelism.pipeline_parallel_degree: {num_stages} pipeline stages for a model of {num_layers} "
            f"decoder layers; use at most {units} stages"
        )
    base, extra = divmod(units, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        size -= first_stage_less if stage == 0 else 0
        size -= last_stage_less if stage == num_stages - 1 else 0
        if size < 0:
            raise UserInputError(
                f"--parallelism.pipeline_parallel_first_stage_less_layers {first_stage_less} / "
                f"_last_stage_less_layers {last_stage_less}: more than stage {stage}'s share of the model's "
                f"{num_layers} layers over {num_stages} stages"
            )
        ranges.append(range(start, start + size))
        start += size
    return ranges


def _describe(layers: range) -> str:
    """A stage's decoder layers, for its log line."""
    if not layers:
        return "no decoder layer"
    return (
        f"decoder layer {layers.start}" if len(layers) == 1 else f"decoder layers {layers.start}-{layers[-1]}"
    )


def _stages_of_rank(rank: int, degree: int, num_stages: int, schedule_class) -> tuple[int, ...]:
    """The stage indices a pp rank runs: looped (``rank, rank + degree, ...``) or, for the V schedules, the
    pair ``(rank, num_stages - 1 - rank)``."""
    if schedule_class in V_SCHEDULES:
        return (rank, num_stages - 1 - rank)
    return tuple(range(rank, num_stages, degree))


def stage_plan(parallelism, num_layers: int) -> list[range]:
    """The decoder layers of each pipeline stage of a ``num_layers``-layer model under ``parallelism``, or one
    line (``UserInputError``) for a plan that cannot be made; checked before launch (``parallelize``)."""
    if parallelism.pipeline_parallel_schedule_csv:
        raise UserInputError(
            "--parallelism.pipeline_parallel_schedule_csv: hf-v5-backend runs torch's named schedules; "
            "leave it empty and name one with --parallelism.pipeline_parallel_schedule"
        )
    degree = parallelism.pipeline_parallel_degree
    schedule_class = get_schedule_class(parallelism.pipeline_parallel_schedule)
    single = not issubclass(schedule_class, PipelineScheduleMulti)
    first, last = (
        parallelism.pipeline_parallel_first_stage_less_layers,
        parallelism.pipeline_parallel_last_stage_less_layers,
    )
    per_stage = parallelism.pipeline_parallel_layers_per_stage
    if per_stage is None:
        num_stages = degree if single else 2 * degree
    else:
        num_stages = -(-(num_layers + first + last) // per_stage)
        if (
            num_stages % degree
            or (single and num_stages != degree)
            or (not single and num_stages < 2 * degree)
        ):
            raise UserInputError(
                f"--parallelism.pipeline_parallel_layers_per_stage {per_stage}: makes {num_stages} stages of the "
                f"model's {num_layers} layers, expected {'exactly' if single else 'a multiple of, and at least twice,'}"
                f" the {degree} pipeline ranks for --parallelism.pipeline_parallel_schedule "
                f"{parallelism.pipeline_parallel_schedule}"
            )
        if schedule_class in V_SCHEDULES and num_stages != 2 * degree:
            raise UserInputError(
                f"--parallelism.pipeline_parallel_layers_per_stage {per_stage}: makes {num_stages} stages of the "
                f"model's {num_layers} layers; --parallelism.pipeline_parallel_schedule "
                f"{parallelism.pipeline_parallel_schedule} runs two stages on each of the {degree} pipeline ranks "
                f"({2 * degree} stages)"
            )
    return stage_layers(num_layers, num_stages, first_stage_less=first, last_stage_less=last)


def pipeline_hf_v5(
    model: nn.Module,
    *,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str,
    device: torch.device,
    model_config,
    parallelize_fn,
    loss_fn,
):
    """torchtitan's ``pipelining_fn`` for ``HFCausalLM``: (schedule, this rank's stage models, whether it holds
    the first stage, whether it holds the last)."""
    pp_mesh = parallel_dims.get_mesh("pp")
    degree, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    schedule_class = get_schedule_class(parallelism.pipeline_parallel_schedule)
    single = not issubclass(schedule_class, PipelineScheduleMulti)
    layers = stage_plan(parallelism, len(model.model.layers))
    num_stages = len(layers)
    stages, parts = [], []
    for index in _stages_of_rank(rank, degree, num_stages, schedule_class):
        part = copy.deepcopy(model).as_pipeline_stage(
            layers[index], first=index == 0, last=index == num_stages - 1
        )
        part = parallelize_fn(
            part,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=compile_config,
            ac_config=ac_config,
            dump_folder=dump_folder,
        )
        logger.info(
            f"[layout] pipeline rank {rank}: stage {index} of {num_stages}, "
            f"{_describe(layers[index])}"
            f"{', the embedding' if index == 0 else ''}{', the norm and lm_head' if index == num_stages - 1 else ''}"
        )
        stages.append(PipelineStage(part, index, num_stages, device, group=pp_mesh.get_group()))
        parts.append(part)

    # A divisor of the rank's batch: train.preflight refuses any other before anything is written.
    micro_batches = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size

    def scalar_loss(*args, **kwargs) -> torch.Tensor:
        loss, _ = loss_fn(*args, **kwargs)
        return loss

    # A single-stage schedule takes its rank's one stage, a looped or V schedule the list.
    schedule = schedule_class(
        stages[0] if single else stages, n_microbatches=micro_batches, loss_fn=scalar_loss, scale_grads=False
    )
    return schedule, parts, any(s.is_first for s in stages), any(s.is_last for s in stages)
