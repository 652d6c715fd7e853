"""Whether a job fits its ranks' memory: the estimate of ``perf.memory`` for rank 0 of the planned job, laid out
on torchtitan's fake process group, against the memory a rank has, and settings that fit when it does not.

The dry run prints it, and a real launch on this machine checks it before torchrun starts when it matters: both
are rank 0 rehearsed (``train.rehearsal``). ``plan``: the job as the rehearsal knows it (``Rehearsal.Config``:
its ranks, nodes, and the memory a rank has).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qwen3_titan_common.perf.memory import StepMemory

GIB = 1024**3
# A job whose weights, gradients and optimizer state do not fit its ranks is tried on its node count times these,
# each node with the job's ranks (so a rank's memory stays what it is), FSDP sharding over them all.
MORE_NODES = (2, 4, 8, 16, 32, 64)
# A model deeper than this has its step tracked at two depths of its first layers and extrapolated per layer: the
# tracker's cost grows with the square of the step's operations (the 48-layer Qwen3-30B-A3B recipe: about 2.5
# minutes a step on the development machine, 8 s at 2 layers), and a dry run that does not fit tracks several.
EXTRAPOLATED_ABOVE = 8
TRACKED_DEPTHS = (2, 4)


@dataclass
class JobModel:
    """What the memory estimate builds again for each setting it tries: the config, its model and its mesh."""

    config: Any
    spec: Any
    parallel_dims: Any
    device_kind: str  # of the job's ranks ('' when unknown)

    def sharded_model(self, ac_config):
        """Rank 0's model on the meta device, sharded as the backend's parallelize function shards it."""
        import torch

        with torch.device("meta"):
            model = self.spec.model.build()
        if not self.parallel_dims.pp_enabled:
            model = self.spec.parallelize_fn(
                model,
                parallel_dims=self.parallel_dims,
                training=self.config.training,
                parallelism=self.config.parallelism,
                compile_config=self.config.compile,
                ac_config=ac_config,
                dump_folder=self.config.dump_folder,
            )
        if getattr(model, "enable_weight_tying", False):
            # As torchtitan's init_states does: sharding replaced the tied parameter.
            model.tok_embeddings.weight = model.lm_head.weight
        return model

    def on_ranks(self, world_size: int) -> JobModel:
        """The same job laid out over ``world_size`` ranks: torchtitan's fake process group started again at that
        size (its fake mode reads the rank count from NGPU), so this job's own mesh is gone afterwards."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ["NGPU"] = os.environ["WORLD_SIZE"] = str(world_size)
        return dataclasses.replace(self, parallel_dims=fake_mesh(self.config, world_size))

    def step_memory(self, *, batch: int, ac_config, baseline_bytes: int) -> StepMemory:
        from qwen3_titan_common.perf.memory import extrapolated

        layers = getattr(self.spec.model, "layers", None)
        if not isinstance(layers, list) or len(layers) <= EXTRAPOLATED_ABOVE:
            return self._tracked_step(batch=batch, ac_config=ac_config, baseline_bytes=baseline_bytes)
        steps = [
            self.first_layers(depth)._tracked_step(
                batch=batch, ac_config=ac_config, baseline_bytes=baseline_bytes
            )
            for depth in TRACKED_DEPTHS
        ]
        if not all(step.tracked and step.candidates and step.after_forward for step in steps):
            return self._tracked_step(batch=batch, ac_config=ac_config, baseline_bytes=baseline_bytes)
        return extrapolated(*steps, TRACKED_DEPTHS, len(layers))

    def first_layers(self, depth: int) -> JobModel:
        """The same job with its model cut to its first ``depth`` decoder layers."""
        model = dataclasses.replace(self.spec.model, layers=self.spec.model.layers[:depth])
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, model=model))

    def _tracked_step(self, *, batch: int, ac_config, baseline_bytes: int) -> StepMemory:
        from qwen3_titan_common.compat import fake_tensor_data_dependent_errors
        from qwen3_titan_common.perf.memory import rule_of_thumb, track_step

        config = self.config
        arch = getattr(config, "architecture", None)
        vocab = arch.vocab_size if arch is not None else self.spec.model.vocab_size
        cp = self.parallel_dims.cp
        try:
            memory = track_step(
                lambda: self.sharded_model(ac_config),
                lambda model: config.optimizer.build(model_parts=[model]),
                batch=batch,
                # Under context parallelism a rank computes its share of each row (models.context_parallel).
                seq_len=config.training.seq_len // cp,
                vocab_size=vocab,
                baseline_bytes=baseline_bytes,
                # Every layout's loss applies the output projection chunk by chunk (components.loss).
                loss_chunks=getattr(config.loss, "num_chunks", None),
                gloo=self.device_kind == "cpu" and self.parallel_dims.world_size > 1,
            )
            memory = self._with_gathered_rows(memory, batch=batch, ac_config=ac_config)
            return self._with_live_reference(memory, ac_config=ac_config)
        except fake_tensor_data_dependent_errors():
            import torch

            with torch.device("meta"):
                model = self.sharded_model(ac_config)
            memory = rule_of_thumb(
                model,
                batch=batch,
                seq_len=config.training.seq_len,
                hidden=arch.hidden_size if arch is not None else self.spec.model.dim,
                layers=arch.num_hidden_layers if arch is not None else len(self.spec.model.layers),
                vocab=vocab,
                tensor_parallel=self.parallel_dims.tp,
                context_parallel=self.parallel_dims.cp,
                fp32_compute=config.training.mixed_precision_param == "float32",
                recomputed=ac_config is not None,
                baseline_bytes=baseline_bytes,
            )
            return self._with_live_reference(memory, ac_config=ac_config)

    def _with_live_reference(self, memory: StepMemory, *, ac_config) -> StepMemory:
        """``memory`` plus the copy of the trained weights that ``--dpo.reference live`` keeps on each rank
        (``train.preference.LiveReference``: its own shards of the parameters that train), which the fake step
        does not hold."""
        import torch

        from qwen3_titan_common.perf.memory import local_numel

        dpo = getattr(self.config, "dpo", None)
        if getattr(self.config, "objective", "sft") != "dpo" or getattr(dpo, "reference", None) != "live":
            return memory
        with torch.device("meta"):
            model = self.sharded_model(ac_config)
        copy = sum(local_numel(p) * p.element_size() for p in model.parameters() if p.requires_grad)

        def added(kinds: dict[str, int] | None) -> dict[str, int] | None:
            return None if kinds is None else {**kinds, "live reference": copy}

        return dataclasses.replace(
            memory,
            by_kind=added(memory.by_kind),
            candidates=tuple(added(k) for k in memory.candidates) if memory.candidates else None,
            after_forward=added(memory.after_forward),
        )

    def _with_gathered_rows(self, memory: StepMemory, *, batch: int, ac_config) -> StepMemory:
        """``memory`` plus what context parallelism adds and a fake step of the rank's share does not show: each
        layer keeps the whole row's gathered keys and values for its backward (every layer's, or one layer's at
        a time when full recomputation recomputes them), beside the rank's own share the tracker counted."""
        from torchtitan.distributed.activation_checkpoint import FullAC

        cp = self.parallel_dims.cp
        arch = getattr(self.config, "architecture", None)
        if cp <= 1 or arch is None:
            return memory
        seq_len = self.config.training.seq_len
        dtype_bytes = 4 if self.config.training.mixed_precision_param == "float32" else 2
        kv_heads = max(1, arch.num_key_value_heads // self.parallel_dims.tp)
        per_layer = 2 * batch * (seq_len - seq_len // cp) * kv_heads * arch.head_dim * dtype_bytes
        layers = 1 if isinstance(ac_config, FullAC.Config) else arch.num_hidden_layers

        def added(kinds: dict[str, int]) -> dict[str, int]:
            return {**kinds, "activations": kinds["activations"] + per_layer * layers}

        candidates = tuple(added(kinds) for kinds in memory.candidates) if memory.candidates else None
        return dataclasses.replace(memory, by_kind=added(memory.by_kind), candidates=candidates)


def fit_line(plan, estimate: StepMemory, memory) -> tuple[str, str]:
    """('fits' | 'near the limit' | 'does not fit', the estimate against the memory in words)."""
    from qwen3_titan_common.perf.fit import verdict

    needed = estimate.total_bytes
    here = "" if plan.memory_per_rank else " here"
    # The memory as stated, to its hundredths (0.85 is not 0.8, and 0.86 beside an estimate of 0.90 not 0.9).
    have = f"{memory.bytes_per_rank / GIB:.2f}".rstrip("0").rstrip(".")
    return verdict(needed, memory), (
        f"~{needed / GIB:.2f} GiB per rank estimated, {have} GiB per rank{here} ({memory.described})"
    )


def does_not_fit(
    job: JobModel, estimate: StepMemory, line: str, memory, nnodes: int, *, runs: Callable[[str], bool]
) -> str:
    """The one line that refuses the job, with what fits by the same estimate: a smaller batch, recomputed
    activations, or (when not even one row fits) more nodes of the job's size. Trying more nodes restarts the
    fake process group, so ``job`` is not to be used afterwards. Where nothing fits, the ways that remain are
    named only where the job could take them: ``runs`` says whether it runs with a higher degree of the
    ``--parallelism`` field it is given (``tensor_parallel_degree``, ``pipeline_parallel_degree``)."""
    config = job.config
    fitting = largest_fitting_batch(job, estimate, memory)
    found = []
    if fitting is not None:
        batch, tried = fitting
        found.append(
            f"--training.local_batch_size (--batch-size) {batch} (~{tried.total_bytes / GIB:.2f} GiB)"
        )
    recomputed = with_full_recomputation(job, estimate)
    if recomputed is not None and recomputed.total_bytes <= memory.bytes_per_rank:
        found.append(
            f"activation-checkpoint:full as the last argument (~{recomputed.total_bytes / GIB:.2f} GiB)"
        )
    if fitting is None:
        split = with_context_parallel(job, estimate, memory)
        if split is not None:
            degree, tried = split
            # Tried at one row: no batch of whole rows fits, so the split needs the batch of one row too.
            batch = config.training.local_batch_size
            one_row = " with --training.local_batch_size (--batch-size) 1" if batch > 1 else ""
            found.append(
                f"--parallelism.context_parallel_degree {degree}{one_row} (each row's tokens over {degree} "
                f"ranks; ~{tried.total_bytes / GIB:.2f} GiB per rank)"
            )
    if fitting is None and not found:
        wider, recomputing = with_more_nodes(job, estimate, memory, nnodes), ""
        moe = getattr(getattr(config, "architecture", None), "is_moe", False)
        if wider is None and recomputed is not None and not moe:
            # Sharded state and recomputed activations together (a long row of a large model). Not for a
            # Qwen3-MoE yet: its model laid out again at another rank count after the recomputed step at this
            # one fails in the experts' mesh bookkeeping (fully_shard sees another mesh object).
            from torchtitan.distributed.activation_checkpoint import FullAC

            wider = with_more_nodes(job, recomputed, memory, nnodes, ac_config=FullAC.Config())
            recomputing = " with activation-checkpoint:full as the last argument"
        if wider is not None:
            nodes, ranks, tried = wider
            found.append(
                f"--nnodes {nodes}{recomputing} ({ranks} ranks, FSDP sharding the weights, gradients and "
                f"optimizer state over them; ~{tried.total_bytes / GIB:.2f} GiB per rank)"
            )
    if found:
        hint = "fits by the same estimate: " + "; or ".join(found)
    elif estimate.baseline_bytes >= memory.bytes_per_rank:
        hint = (
            f"the process alone holds ~{estimate.baseline_bytes / GIB:.2f} GiB before any of the model's tensors "
            "(its libraries, and the weights it reads): no layout of this job fits"
        )
    else:
        # What else shrinks a rank's share: fewer weights that train (LoRA), or a split of each layer or of the
        # layers, where the job runs with it; else shorter rows.
        ways = [] if getattr(getattr(config, "lora", None), "enabled", False) else ["train LoRA adapters"]
        splits = [
            f"{'more ' if getattr(config.parallelism, field) > 1 else ''}{what}"
            for field, what in (
                ("tensor_parallel_degree", "tensor"),
                ("pipeline_parallel_degree", "pipeline"),
            )
            if runs(field)
        ]
        if splits:
            ways.append(f"shard with {' or '.join(splits)} parallelism")
        hint = (
            f"no smaller batch, recomputation, context parallelism or up to {MORE_NODES[-1]}x the nodes fits by "
            f"the same estimate: {', or '.join(ways) if ways else 'shorter rows (--training.seq_len)'}"
        )
    return (
        f"--training.local_batch_size {config.training.local_batch_size} (--batch-size) x --training.seq_len "
        f"{config.training.seq_len}: does not fit, {line}; {hint}"
    )


def largest_fitting_batch(job: JobModel, estimate: StepMemory, memory) -> tuple[int, StepMemory] | None:
    """The largest batch below the job's that fits, each candidate tracked like the job; None if even 1 does not."""
    from qwen3_titan_common.perf.fit import largest_batch

    batch = job.config.training.local_batch_size
    ac = job.config.activation_checkpoint
    if batch <= 1:
        return None
    one = job.step_memory(batch=1, ac_config=ac, baseline_bytes=estimate.baseline_bytes)
    if one.total_bytes > memory.bytes_per_rank:
        return None
    # Activations grow with the batch; the rest does not: the first candidate on the line through both.
    per_row = max(1, (estimate.total_bytes - one.total_bytes) // (batch - 1))
    candidate = min(largest_batch(one.total_bytes - per_row, per_row, 1, memory), batch - 1)
    while candidate > 1:
        tried = job.step_memory(batch=candidate, ac_config=ac, baseline_bytes=estimate.baseline_bytes)
        if tried.total_bytes <= memory.bytes_per_rank:
            return candidate, tried
        candidate = candidate * 3 // 4 if candidate > 4 else candidate - 1
    return 1, one


def with_more_nodes(
    job: JobModel, estimate: StepMemory, memory, nnodes: int, ac_config=None
) -> tuple[int, int, StepMemory] | None:
    """(nodes, ranks, their estimate) for the fewest nodes, the job's ``nnodes`` times one of :data:`MORE_NODES`,
    whose ranks hold enough of the sharded state to fit at the job's batch, tracked like the job (with
    ``ac_config`` in place of its activation checkpointing where given, ``estimate`` the job's under it); None if
    none does, or if the job fixes its FSDP degree (``--parallelism.data_parallel_shard_degree``), which more
    ranks would not lay out."""
    from qwen3_titan_common.models.layout import LayoutError, resolve_layout

    config = job.config
    world = job.parallel_dims.world_size
    state = sum(estimate.by_kind.get(kind, 0) for kind in ("params", "grads", "optimizer", "live reference"))
    rest = estimate.total_bytes - state
    for factor in MORE_NODES:
        # Only the sharded state shrinks with more ranks: a count that cannot fit by that alone is not tracked.
        if rest + state // factor > memory.bytes_per_rank:
            continue
        try:
            resolve_layout(config.parallelism, world * factor)
        except LayoutError:
            return None
        wider = job.on_ranks(world * factor)
        tried = wider.step_memory(
            batch=config.training.local_batch_size,
            ac_config=config.activation_checkpoint if ac_config is None else ac_config,
            baseline_bytes=estimate.baseline_bytes,
        )
        if tried.total_bytes <= memory.bytes_per_rank:
            return nnodes * factor, world * factor, tried
    return None


def with_context_parallel(job: JobModel, estimate: StepMemory, memory) -> tuple[int, StepMemory] | None:
    """(degree, its estimate) for the smallest context-parallel degree above the job's, over the job's own ranks,
    at which one row fits, tracked like the job; None where the model's attention has no CP of ours
    (``models.context_parallel``) or no degree that divides the ranks and the row fits. Restarts the fake process
    group, so ``job`` is not to be used afterwards."""
    import torch.distributed as dist

    from qwen3_titan_common.models.attention import parallelism_for_document_cp, uses_document_blocks
    from qwen3_titan_common.models.layout import LayoutError, resolve_layout

    config = job.config
    world, seq_len = job.parallel_dims.world_size, config.training.seq_len
    if not uses_document_blocks(config.model_spec.model) or job.parallel_dims.pp_enabled:
        return None
    degree = job.parallel_dims.cp * 2
    while degree <= world:
        parallelism = dataclasses.replace(config.parallelism, context_parallel_degree=degree)
        if world % degree == 0 and seq_len % (2 * degree) == 0:
            try:
                resolve_layout(parallelism, world)
            except LayoutError:
                return None
            parallelism = parallelism_for_document_cp(
                parallelism, model_config=config.model_spec.model, seq_len=seq_len
            )
            split = dataclasses.replace(config, parallelism=parallelism)
            if dist.is_initialized():
                dist.destroy_process_group()
            tried = dataclasses.replace(job, config=split, parallel_dims=fake_mesh(split, world)).step_memory(
                batch=1, ac_config=config.activation_checkpoint, baseline_bytes=estimate.baseline_bytes
            )
            if tried.total_bytes <= memory.bytes_per_rank:
                return degree, tried
        degree *= 2
    return None


def with_full_recomputation(job: JobModel, estimate: StepMemory) -> StepMemory | None:
    from torchtitan.distributed.activation_checkpoint import FullAC

    ac = job.config.activation_checkpoint
    if isinstance(ac, FullAC.Config):
        return None
    batch = job.config.training.local_batch_size
    return job.step_memory(batch=batch, ac_config=FullAC.Config(), baseline_bytes=estimate.baseline_bytes)


def rank_memory_of(plan, device: str | None = None):
    """The memory one rank has: stated (--memory-per-rank), else that of a rank on ``device`` here (the dry run
    passes this machine's kind only for a job here, without --nproc), else unknown."""
    from qwen3_titan_common.perf.fit import rank_memory, stated_memory

    if plan.memory_per_rank:
        return stated_memory(plan.memory_per_rank)
    return rank_memory(device, plan.nproc_per_node) if device else None


def estimate_rank0(plan, config, device_kind: str) -> tuple[JobModel, StepMemory]:
    """Rank 0 of ``plan`` on torchtitan's fake process group (initialised here; the caller destroys it): its model
    and its step's memory at the config's batch. The process must be rank 0 of the job already
    (``train.rehearsal.rank0_environment``)."""
    from torchtitan.tools import utils as titan_utils

    from qwen3_titan_common.models.ep_dispatch import with_token_dispatcher
    from qwen3_titan_common.perf.memory import process_baseline_bytes, weights_read_bytes
    from qwen3_titan_common.runtime.quiet import quiet_router_autocast_on_cpu

    quiet_router_autocast_on_cpu(titan_utils.device_type)  # the fake step runs this CPU's autocast

    # Before the model: what a rank of a one-node job on this machine's CPU holds of its own, and what reading
    # its weights leaves there.
    baseline = process_baseline_bytes(device_kind) + weights_read_bytes(
        getattr(getattr(config, "hf", None), "model_dir", None), device_kind
    )
    spec = config.model_spec
    factor = estimated_capacity_factor(config)
    if factor is not None:
        # The fixed-capacity exchange, whose shapes do not depend on the routing, so torch's memory tracker
        # can follow it.
        spec = dataclasses.replace(spec, model=with_token_dispatcher(spec.model, factor))
        config = dataclasses.replace(config, model_spec=spec)
    spec.model.update_from_config(config=config)
    job = JobModel(config, spec, fake_mesh(config, plan.world_size), device_kind)
    batch = config.training.local_batch_size
    return job, job.step_memory(batch=batch, ac_config=config.activation_checkpoint, baseline_bytes=baseline)


def estimated_capacity_factor(config) -> float | None:
    """The expert exchange's capacity the estimate lays out (the fixed-capacity one, ``models.ep_dispatch``), in
    multiples of a balanced load; None without expert parallelism. It is the exchange a Neuron job runs; for an
    exchange of exactly the routed rows (CPU, CUDA) its default of 2x a balanced load is the room an expert twice
    as busy as average needs, so the estimate has headroom for uneven routing rather than none."""
    from qwen3_titan_common.models.ep_dispatch import DEFAULT_CAPACITY_FACTOR

    architecture = getattr(config, "architecture", None)
    if config.parallelism.expert_parallel_degree <= 1 or not getattr(architecture, "is_moe", False):
        return None
    moe = getattr(config, "moe", None)
    return getattr(moe, "capacity_factor", None) or DEFAULT_CAPACITY_FACTOR


def fake_mesh(config, world_size: int):
    """torchtitan's fake process group of ``world_size`` ranks (its size read from NGPU) and the job's mesh on
    it."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    dist_utils.init_distributed(config.comm)
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    parallel_dims.build_mesh()
    return parallel_dims
