"""The output projection of a model trained whole on one CPU rank, in its compute dtype, without autocast's
per-chunk conversions.

Under bf16 autocast over fp32 weights (``models.fsdp_comms``), a chunked loss (``train.loss``) projecting each
chunk through autocast computes the chunk's weight gradient in bf16 and sends it back to fp32 on fresh buffers
the size of the vocabulary's weight, twice a chunk; on a CPU, faulting in fresh memory is much of a step.
:class:`ComputeDtypeProjection` gives the same logits and hidden-state gradients (the same bf16 products), and
sums the weight's gradient over a loss call's chunks in one fp32 buffer by fp32 products (closer to the exact
gradient than autocast's bf16 ones). The memory estimate (``perf.memory``) projects through it as the run does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


class ComputeDtypeProjection:
    """A bias-free output projection in the compute dtype: the logits from a compute-dtype copy of the fp32
    weight (refreshed each loss call, its buffer kept across calls), and the weight's gradient summed over the
    loss call's chunks in fp32, each chunk's added in place by one fp32 product, and handed to the weight by
    the last chunk's backward (the chunked loss runs each chunk's backward right after its forward)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.weight = weight
        self.weight_VD = torch.empty_like(weight, dtype=dtype)
        self.weight_grad: torch.Tensor | None = None
        self.chunks_left = 0

    @classmethod
    def of(
        cls,
        lm_head,
        compute_dtype: torch.dtype | None,
        *,
        chunks: int,
        kept: ComputeDtypeProjection | None = None,
    ) -> ComputeDtypeProjection | None:
        """The projection of one loss call in ``chunks`` chunks, for ``lm_head`` where autocast would compute it in
        ``compute_dtype`` over a plain (unsharded) fp32 ``nn.Linear`` without bias, reusing ``kept``'s buffer when
        it is for the same weight; otherwise None (autocast's projection)."""
        if compute_dtype is None or not isinstance(lm_head, torch.nn.Linear) or lm_head.bias is not None:
            return None
        weight = lm_head.weight
        if isinstance(weight, DTensor) or weight.dtype != torch.float32 or compute_dtype == weight.dtype:
            return None
        projection = kept if kept is not None and kept.weight is weight else cls(weight, compute_dtype)
        with torch.no_grad():
            projection.weight_VD.copy_(weight)
        projection.weight_grad, projection.chunks_left = None, chunks
        return projection

    def __call__(self, hidden_BND: torch.Tensor) -> torch.Tensor:
        return _ProjectInComputeDtype.apply(hidden_BND, self.weight, self.weight_VD, self)

    def weight_grad_of_chunk(self, grad_NV: torch.Tensor, hidden_ND: torch.Tensor) -> torch.Tensor | None:
        """Adds grad_NV.T @ hidden_ND (fp32) to the sum; the sum after the last chunk, else None."""
        if self.weight_grad is None:
            self.weight_grad = grad_NV.t() @ hidden_ND
        else:
            self.weight_grad.addmm_(grad_NV.t(), hidden_ND)
        self.chunks_left -= 1
        if self.chunks_left > 0:
            return None
        # Autograd then holds the only reference: the weight takes the sum as its gradient without a copy, and
        # the tied embedding's rows are added into it in place (``models.fsdp_comms``).
        weight_grad, self.weight_grad = self.weight_grad, None
        return weight_grad


class _ProjectInComputeDtype(torch.autograd.Function):
    """fp32 logits of hidden @ weight.T computed in the weight copy's dtype, as autocast's projection and the
    cross-entropy's fp32 cast give them; the hidden states' gradient in that dtype as autocast's, the weight's
    in fp32 from the projection (``weight`` is an input for that gradient only; ``weight_VD`` is its copy)."""

    @staticmethod
    def forward(ctx, hidden_BND, weight, weight_VD, projection):
        ctx.save_for_backward(hidden_BND, weight_VD)
        ctx.projection = projection
        return (hidden_BND.to(weight_VD.dtype) @ weight_VD.t()).float()

    @staticmethod
    def backward(ctx, grad_BNV):
        hidden_BND, weight_VD = ctx.saved_tensors
        # The chunked loss runs each chunk's backward inside its autocast: the dtypes here are explicit.
        with torch.autocast(grad_BNV.device.type, enabled=False):
            grad_BNV = grad_BNV.float()
            weight_grad = None
            if ctx.needs_input_grad[1]:
                weight_grad = ctx.projection.weight_grad_of_chunk(
                    grad_BNV.reshape(-1, grad_BNV.shape[-1]),
                    hidden_BND.reshape(-1, hidden_BND.shape[-1]).float(),
                )
            grad_hidden_BND = grad_BNV.to(weight_VD.dtype) @ weight_VD
        return grad_hidden_BND.to(hidden_BND.dtype), weight_grad, None, None
