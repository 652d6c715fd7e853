"""A rank's peak memory in a training step, estimated before launch by torch's own memory tracker.

The job's model, built and sharded as its rank 0 builds it (on torchtitan's fake process group, see
``train.rehearsal``), takes a training step on fake tensors: shapes, dtypes and devices, no storage and no
arithmetic, so a 30B shape costs seconds. Torch's FSDP memory tracker (``compat.step_memory_tracker``;
torchtitan's own estimator used it until it was removed) follows every tensor the step creates and frees, and
reports the peak by kind: sharded parameters and gradients, the optimizer's state, activations and the
backward's temporaries (the logits at the model's vocabulary, their fp32 copy and gradient included), FSDP's
unsharded parameters and its all-gather and reduce-scatter buffers, in the precision the config computes in.
The steady state is the second step's: AdamW creates its state in the first (``track_step``). This replaces a
per-token rule of thumb that measured 0.5x of a real-width run: at a 151,936-token vocabulary the buffers of the
tied embedding's gradient reduction and the optimizer's state outweigh the layers' activations at short
sequences.

What the tracker cannot see is the process. On the CPU a rank's measured peak is its resident memory, which
starts at the interpreter with torch, torchtitan, transformers and the data libraries imported (the process
that estimates has imported the same, so its resident memory before the model is built is that baseline),
keeps about the safetensors files' size after reading Hugging Face weights, and holds gloo's copies of each
collective's buffer while it runs (two, measured). A CUDA rank's peak is the caching allocator's (no
baseline); a Neuron rank's runtime keeps its own share outside the 24 GiB per logical core of ``perf.fit``.
Estimate against measured peaks: ``tools/bench_memory.py``, docs/performance.md.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

GIB = 1024**3

# The tracker's kinds, grouped as the dry run prints them (FSDP's tracker and the plain one name them apart).
_KINDS = {
    "params": ("Sharded Param", "Parameter", "Buffer"),
    "grads": ("Sharded Grad", "Gradient"),
    "optimizer": ("OptState", "Optstate"),
    "activations": ("Activation", "Temp", "Inputs", "Other"),
    "FSDP buffers": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
}


@dataclass(frozen=True)
class StepMemory:
    """One rank's memory at the peak of a training step, by kind, and the process's own."""

    batch: int
    by_kind: dict[str, int]  # the tensors live at the step's peak, grouped as in _KINDS
    baseline_bytes: int  # the process's own: its imports and the weights it read, on the CPU; else 0
    tracked: bool = True  # False: the rule of thumb, for a layout fake tensors cannot run (rule_of_thumb)
    # (depths tracked, the model's depth) where a deep model's step was extrapolated per layer (extrapolated)
    extrapolated_from: tuple[tuple[int, int], int] | None = None
    # The tracked step's two peaks, by kind: the forward and backward's (with the moments) and the optimizer
    # step's end; by_kind is the larger
    candidates: tuple[dict[str, int], dict[str, int]] | None = None
    after_forward: dict[str, int] | None = None  # the tensors live when the forward and the loss are done

    @property
    def step_bytes(self) -> int:
        return sum(self.by_kind.values())

    @property
    def total_bytes(self) -> int:
        return self.step_bytes + self.baseline_bytes

    def describe(self) -> str:
        kinds = ", ".join(f"{name} {nbytes / GIB:.2f}" for name, nbytes in self.by_kind.items())
        process = f" + process {self.baseline_bytes / GIB:.2f}" if self.baseline_bytes else ""
        return f"{kinds}{process}; total ~{self.total_bytes / GIB:.2f} GiB"


def extrapolated(shallow: StepMemory, deeper: StepMemory, depths: tuple[int, int], layers: int) -> StepMemory:
    """The step of a model of ``layers`` layers from the steps of its first ``depths`` layers.

    Every decoder layer of a Qwen3 model has the same shapes, so what a step keeps grows by the same amount per
    layer, and the rest (embeddings, output projection, logits) is there once: what the forward keeps for the
    backward (``after_forward``) and the optimizer step's end are extrapolated per layer, kind by kind. The
    backward's peak is not: where it falls moves with the depth (at 2 layers of a MoE model one layer's token
    exchange, 2.7 GiB at 4,096 tokens, outweighs what the layers keep, 0.06 GiB each; at 48 the kept activations
    do). It is taken as what the deep model's forward keeps, with AdamW's moments, plus what the deeper tracked
    step holds above those at its peak (the backward's temporaries, which do not grow with the depth)."""
    low, high = depths

    def per_layer(few: dict[str, int], more: dict[str, int]) -> dict[str, int]:
        return {kind: few[kind] + (more[kind] - few[kind]) * (layers - low) // (high - low) for kind in few}

    (_, few_end), (deeper_peak, more_end) = shallow.candidates, deeper.candidates
    step_end = per_layer(few_end, more_end)
    kept = per_layer(shallow.after_forward, deeper.after_forward)
    # The moments exist from the first optimizer step on; the tracked forward ran before it.
    moments, deeper_moments = step_end["optimizer"], more_end["optimizer"]
    backward = {
        kind: kept[kind]
        + deeper_peak[kind]
        - deeper.after_forward[kind]
        + (moments - deeper_moments if kind == "optimizer" else 0)
        for kind in kept
    }
    # A kind the peak holds less of than the forward's end (FSDP's unsharded weights) moves to no other kind.
    by_kind = max(backward, step_end, key=lambda kinds: sum(kinds.values()))
    return StepMemory(
        batch=shallow.batch,
        by_kind={kind: max(0, nbytes) for kind, nbytes in by_kind.items()},
        baseline_bytes=shallow.baseline_bytes,
        extrapolated_from=(depths, layers),
    )


def local_numel(param) -> int:
    """The elements this rank holds of a parameter (its shard when sharded)."""
    from torch.distributed.tensor import DTensor

    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def grouped(by_tracker_kind: dict[str, int]) -> dict[str, int]:
    """The tracker's kinds summed into the groups the dry run prints; a kind it does not know is an activation."""
    out = dict.fromkeys(_KINDS, 0)
    for kind, nbytes in by_tracker_kind.items():
        group = next((name for name, kinds in _KINDS.items() if kind in kinds), "activations")
        out[group] += nbytes
    return out


def safetensors_bytes(model_dir: str | None) -> int:
    """The size of a Hugging Face directory's safetensors files (0 without a directory)."""
    from pathlib import Path

    folder = Path(model_dir).expanduser() if model_dir else None
    if folder is None or not folder.is_dir():
        return 0
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def weights_read_bytes(model_dir: str | None, device_kind: str) -> int:
    """On the CPU, what loading a Hugging Face directory leaves resident: its safetensors files' size (measured: a
    rank's host memory grows by about the files' size while torch's reader loads them, and stays there)."""
    return safetensors_bytes(model_dir) if device_kind == "cpu" else 0


def process_baseline_bytes(device_kind: str) -> int:
    """What a rank holds before its model on ``device_kind``: this process's resident memory on the CPU (it has
    imported what a rank imports), nothing on an accelerator (the allocator counts only tensors)."""
    if device_kind != "cpu":
        return 0
    try:
        with open("/proc/self/statm") as statm:
            import os

            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _shared_buffers(model) -> list[list[tuple[object, str]]]:
    """The (module, name) of each buffer that several modules hold (one RoPE cache for every layer,
    ``models.qwen3.share_rope_caches``), grouped by buffer."""
    owners: dict[int, list[tuple[object, str]]] = {}
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            owners.setdefault(id(buffer), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _has_expert_parallel_params(params) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ()) for p in params)


def _local_logits(logits, labels):
    """Tensor parallelism's logits on ``partial_dtensor`` (under context parallelism) are a DTensor sharded along
    the vocabulary, which torchtitan's vocabulary-parallel cross-entropy reads shard by shard: each rank's
    shard, the labels brought into it (the step is fake: only the shapes count)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(logits, DTensor):
        return logits, labels
    local = logits.to_local()
    return local, labels % local.shape[-1]


def track_step(
    build: Callable[[], object],
    build_optimizer: Callable[[object], object],
    *,
    batch: int,
    seq_len: int,
    vocab_size: int,
    baseline_bytes: int,
    loss_chunks: int | None = None,
    device: str = "cpu",
    gloo: bool = False,
) -> StepMemory:
    """The steady-state peak of a training step of the model ``build()`` returns, on fake ``batch x seq_len`` rows.

    One step is tracked: the next one differs only in holding AdamW's moments from the start, so its peak is
    this step's forward-and-backward peak plus the moments, or the end of the optimizer step, whichever is
    larger (tracking a second step doubles the time).

    ``build`` constructs the sharded model on the meta device, outside the fake mode (sharding reads the device
    meshes' real rank tensors); its meta parameters are then materialised as fake tensors on ``device``.
    ``build_optimizer`` builds its optimizer. Attention is costed as
    causal: per-document attention saves what causal SDPA saves, and its extra buffers (a group's gathered
    keys on the CPU, a chunk's scores elsewhere) live inside one layer's call, as the fused causal kernel's
    do. ``loss_chunks``: the run's loss applies the output projection in that many chunks (``components.loss``), so
    one chunk's logits are alive at a time (fused with the cross-entropy by ``perf.projection`` for a model
    trained whole in bf16, as that loss does, its buffers kept for the step); None: the whole batch's logits,
    as torchtitan's plain cross-entropy. ``gloo``: the job's collectives run on gloo (a CPU job of several
    ranks), whose all-gather and reduce-scatter hold two copies of their buffer while they run (measured,
    ``docs/performance.md``), outside any tensor the tracker sees: they are added for each call.
    """
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.utils import clip_grad_norm_

    from qwen3_titan_common.compat import (
        apply_lm_head_in_loss,
        fake_tensor_mode,
        gloo_collective_copies,
        materialise_meta_tensors,
        step_memory_tracker,
        tracker_current_by_kind,
        tracker_peak_by_kind,
    )
    from qwen3_titan_common.perf.precision import compute_autocast, model_compute_dtype
    from qwen3_titan_common.perf.projection import ProjectionCrossEntropy

    # Built and sharded on the meta device outside the fake mode: sharding concatenates device meshes (context
    # and expert parallelism), whose rank tensors are real and are read (fake tensors have no values to read).
    model = build()
    with fake_tensor_mode():
        if isinstance(model, FSDPModule):
            shared = _shared_buffers(model)
            model.to_empty(device=device)  # FSDP's sharded parameters, each registered once
            for owners in shared:  # to_empty gives each module its own; the run's modules share them again
                first, name = owners[0]
                for module, other in owners[1:]:
                    setattr(module, other, getattr(first, name))
        elif any(param.is_meta for param in model.parameters()):
            materialise_meta_tensors(model, device)
        if getattr(model, "enable_weight_tying", False):
            # to_empty gave the tied pair two tensors; torchtitan's init_states re-ties them after it.
            model.tok_embeddings.weight = model.lm_head.weight
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                # torch's tracker cannot read a sparse tensor's storage; a tied embedding's gradient (rows, on one
                # CPU rank: models.fsdp_comms) is counted as the dense buffer it would otherwise be.
                module.sparse = False
        model.train()
        params = list(model.parameters())
        optimizer = build_optimizer(model)
        tokens = torch.randint(0, vocab_size, (batch, seq_len), device=device)
        labels = torch.randint(0, vocab_size, (batch, seq_len), device=device)
        if loss_chunks:
            apply_lm_head_in_loss(model)
        tracker = step_memory_tracker(model, optimizer, (tokens, labels))
        with tracker, gloo_collective_copies(2) if gloo else contextlib.nullcontext():
            output = model(tokens)
            if loss_chunks:
                # The run's loss projects one chunk of the trained tokens at a time (every fake label is
                # trained); one chunk's logits stand for each (torch's FSDP tracker takes one call per module).
                chunk = -(-batch * seq_len // loss_chunks)
                hidden = output.reshape(batch * seq_len, -1)[:chunk]
                chunk_labels = labels.reshape(-1)[:chunk]
                compute_dtype = model_compute_dtype(model)
                projection = ProjectionCrossEntropy.of(model.lm_head, compute_dtype)
                if projection is None:
                    # As the loss applies it (``components.loss``).
                    with compute_autocast(compute_dtype):
                        logits = model.lm_head(hidden)
                    loss = torch.nn.functional.cross_entropy(*_local_logits(logits.float(), chunk_labels))
                    del logits
                else:
                    # A model trained whole on one CPU rank, as its loss runs: the fused chunk gives the weight
                    # its gradient, then the decoder's backward runs from the hidden states' gradient. Its
                    # buffers stay alive through the step, as the run keeps them across steps.
                    cut = hidden.detach().requires_grad_()
                    _, grad = projection(cut, chunk_labels, chunk_rows=chunk)
                    loss = (hidden * grad.to(hidden.dtype)).sum()
            else:
                # torchtitan's loss: fp32 cross-entropy over the flattened logits.
                loss = torch.nn.functional.cross_entropy(
                    *_local_logits(output.flatten(0, 1).float(), labels.flatten(0, 1))
                )
            del output
            # What the forward keeps for the backward, each layer's share alike (extrapolated).
            after_forward = grouped(tracker_current_by_kind(tracker))
            loss.backward()
            forward_backward = grouped(tracker_peak_by_kind(tracker))
            # As torchtitan's Trainer clips: expert-parallel experts sit on a mesh of their own.
            clip_grad_norm_(params, 1.0, foreach=True, ep_enabled=_has_expert_parallel_params(params))
            optimizer.step()
            # Parameters, gradients and AdamW's moments (created by this first step, kept for the next).
            after_step = grouped(tracker_current_by_kind(tracker))
            optimizer.zero_grad()
        with_state = {
            **forward_backward,
            "optimizer": forward_backward["optimizer"] + after_step["optimizer"],
        }
        # The steady state's peak: the next step's forward and backward with the moments alive, or the end of the
        # optimizer step. Not the tracker's peak inside the step: on sharded (DTensor) parameters it also counts
        # the global-shape tensors DTensor's sharding propagation creates on fake tensors (60 GiB per rank for
        # Qwen3-4B on 64 ranks, whose moments are 0.75 GiB); the fused AdamW updates in place.
        by_kind = max(with_state, after_step, key=lambda kinds: sum(kinds.values()))
    return StepMemory(
        batch=batch,
        by_kind=by_kind,
        baseline_bytes=baseline_bytes,
        candidates=(with_state, after_step),
        after_forward=after_forward,
    )


def rule_of_thumb(
    model, *, batch: int, seq_len: int, hidden: int, layers: int, vocab: int, tensor_parallel: int,
    context_parallel: int, fp32_compute: bool, recomputed: bool, baseline_bytes: int,
) -> StepMemory:  # fmt: skip
    """The estimate where fake tensors cannot run the step: an op whose output shape depends on the data (expert
    parallelism's token selection) has no fake tensor. Weights from the sharded ``model``: fp32 parameters, and
    for what trains a gradient and AdamW's two moments; activations by Korthikanti et al. (2022): about 34 x
    hidden bytes per token and layer in bf16 kept for the backward (twice in fp32, a quarter recomputed), and the
    logits at the vocabulary with their fp32 copy and gradient. An upper bound for planning, not a trace."""
    params = sum(local_numel(p) for p in model.parameters())
    trainable = sum(local_numel(p) for p in model.parameters() if p.requires_grad)
    tokens = batch * seq_len
    per_layer = 34 * hidden * tokens // (tensor_parallel * context_parallel)
    per_layer = per_layer * 2 if fp32_compute else per_layer
    per_layer = per_layer // 4 if recomputed else per_layer
    logits = tokens * vocab * ((4 if fp32_compute else 2) + 4 + 4) // tensor_parallel
    by_kind = {
        "params": 4 * params, "grads": 4 * trainable, "optimizer": 8 * trainable,
        "activations": per_layer * layers + logits, "FSDP buffers": 0,
    }  # fmt: skip
    return StepMemory(batch=batch, by_kind=by_kind, baseline_bytes=baseline_bytes, tracked=False)
