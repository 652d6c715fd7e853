"""Data parallelism as CPU ranks need it: FSDP2 reducing over gloo, and none at all on one rank.

torchtitan turns FSDP's gradient division off (it scales the loss by the global token count
itself), so each reduce-scatter is a plain sum in effect; FSDP2 still issues it as
``ReduceOp.PREMUL_SUM``, which gloo does not implement ("Cannot use ReduceOp.PREMUL_SUM with Gloo"
on the first backward of a multi-rank CPU run). Forcing ``SUM`` changes nothing numerically.

One CPU rank trains a dense model whole (a mixture of experts keeps FSDP2: :func:`trains_whole`).
torchtitan 0.3.0's parallelize functions apply FSDP2 on any rank count, and on one rank it shards nothing yet
still copies every parameter into its all-gather buffers and every gradient through its reduce path each step,
on fresh buffers of the weights' size: at Qwen3-0.6B's width (8 layers, one row of 1,024 tokens) that was over
half of a CPU step, most of it the tied 151,936-row embedding's group (docs/performance.md). Without FSDP the
bf16 compute comes from ``torch.autocast``, as torchtitan documents single-device mixed precision
(``TrainingConfig.mixed_precision_param``): fp32 weights and gradients, the matrix products in bf16. Not on
CUDA (FSDP2's mixed precision is what torchtitan's CUDA graphs and compile paths are tested with) nor Neuron.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import wraps

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.tools import utils as titan_utils


def reduces_over_gloo() -> bool:
    """Whether this process's default group is gloo only (CPU ranks)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"


def use_sum_reduction_on_gloo(model: nn.Module) -> bool:
    """Make every FSDP2 group of ``model`` reduce with ``SUM`` when the ranks talk over gloo.

    Call after the model is sharded. Returns whether anything was changed.
    """
    if not reduces_over_gloo():
        return False
    fsdp_modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for module in fsdp_modules:
        module.set_force_sum_reduction_for_comms(True)
    return bool(fsdp_modules)


def trains_whole(parallel_dims, model: nn.Module | None = None) -> bool:
    """Whether the job is one CPU rank whose model trains without FSDP: a dense one. A mixture of experts keeps
    FSDP2's bf16 weights: its grouped expert products (``F.grouped_mm``) are not among the ops autocast casts,
    so they would run in fp32, and torch's fake grouped_mm (the memory estimate) takes bf16 only."""
    if parallel_dims.world_size != 1 or titan_utils.device_type != "cpu":
        return False
    return model is None or not any(name.endswith("experts") for name, _ in model.named_modules())


def trained_whole(model: nn.Module, *, bf16: bool) -> nn.Module:
    """``model`` set up to train whole on one CPU rank: its ``compute_dtype`` the bf16 its forward autocasts to
    when the run computes in bf16, a tied embedding's gradient as rows."""
    model.compute_dtype = torch.bfloat16 if bf16 else None
    if getattr(model, "enable_weight_tying", False):
        # The lookup's gradient as rows: the tied projection's dense gradient of the same weight reaches
        # autograd before it (the chunked loss runs the projection's backward first) or in the same
        # sum, so the rows are added into that in place, not into a zeroed vocabulary-sized buffer each
        # step. An untied embedding keeps its dense gradient (the optimizer takes dense ones only).
        model.tok_embeddings.sparse = True
    # Under autocast the norms get bf16 activations and fp32 weights, which torch's fused rms_norm does
    # not take: it computes them unfused (in fp32, as transformers' own RMSNorm does) and says so once.
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)
    return model


def parallelized_for_the_job(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """A model spec's ``parallelize_fn`` that leaves a dense one-CPU-rank model whole (:func:`trained_whole`),
    and otherwise has its FSDP2 groups reduce with ``SUM`` over gloo. ``parallelize_fn`` takes torchtitan's
    ``skip_dp``."""

    @wraps(parallelize_fn)
    def parallelize(model: nn.Module, **kwargs) -> nn.Module:
        if trains_whole(kwargs["parallel_dims"], model) and not kwargs.get("skip_dp"):
            model = parallelize_fn(model, **{**kwargs, "skip_dp": True})
            return trained_whole(model, bf16=kwargs["training"].mixed_precision_param == "bfloat16")
        model = parallelize_fn(model, **kwargs)
        use_sum_reduction_on_gloo(model)
        return model

    return parallelize
