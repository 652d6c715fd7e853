"""The output projection and cross-entropy of a model trained whole on one CPU rank, fused, in its compute
dtype.

Under bf16 autocast over fp32 weights (``models.fsdp_comms``), a chunked loss (``components.loss``) that projects
each chunk through autocast and torch's cross-entropy creates, per chunk, the bf16 logits, their fp32 copy, the
log-probabilities, their gradient, its bf16 copy, and the weight's bf16 gradient with its fp32 copy: buffers
the size of the chunk's logits or of the vocabulary's weight, fresh each time, and on a CPU faulting fresh
memory in is much of a step. Torch has no fused projection and cross-entropy for the CPU, so
:class:`ProjectionCrossEntropy` computes each chunk's loss and gradients within the loss's forward (as the
chunked loss does: it runs each chunk's backward right after its forward, with the loss's gradient 1) in two
buffers of one chunk's logits, fp32 and the compute dtype's, kept across steps. The logits and the hidden
states' gradient are the same compute-dtype products as autocast's; the softmax and its gradient are computed
in place in fp32; the weight's gradient is summed over the chunks by fp32 products (closer to the exact
gradient than autocast's bf16 ones) into the weight's ``.grad``, a buffer also kept across steps. The memory
estimate (``perf.memory``) projects through it as the run does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX


class ProjectionCrossEntropy:
    """Cross-entropy of ``hidden @ weight.T`` for a bias-free fp32 weight, computed in the compute dtype
    from a copy of the weight refreshed each call (:meth:`of`), chunk by chunk in kept buffers."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.weight = weight
        self.weight_VD = torch.empty_like(weight, dtype=dtype)
        self._weight_grad_VD: torch.Tensor | None = None
        self._logits_CV: torch.Tensor | None = None  # the compute dtype's products
        self._probs_CV: torch.Tensor | None = None  # fp32: the softmax, then the logits' gradient

    @classmethod
    def of(
        cls, lm_head, compute_dtype: torch.dtype | None, *, kept: ProjectionCrossEntropy | None = None
    ) -> ProjectionCrossEntropy | None:
        """The projection for ``lm_head`` where autocast would compute it in ``compute_dtype`` over a plain
        (unsharded) fp32 ``nn.Linear`` without bias, reusing ``kept``'s buffers when it is for the same weight;
        otherwise None (autocast's projection)."""
        if compute_dtype is None or not isinstance(lm_head, torch.nn.Linear) or lm_head.bias is not None:
            return None
        weight = lm_head.weight
        if isinstance(weight, DTensor) or weight.dtype != torch.float32 or compute_dtype == weight.dtype:
            return None
        projection = kept if kept is not None and kept.weight is weight else cls(weight, compute_dtype)
        with torch.no_grad():
            projection.weight_VD.copy_(weight)
        return projection

    def __call__(
        self, hidden_ND: torch.Tensor, labels_N: torch.Tensor, *, chunk_rows: int, divisor=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sum of the rows' cross-entropy (labels ``IGNORE_INDEX`` left out) divided by ``divisor``, as
        fp32, ``chunk_rows`` rows at a time. With ``hidden_ND.requires_grad`` also the loss's gradient with
        respect to ``hidden_ND`` (fp32), and its gradient with respect to the weight added into ``weight.grad``
        (set to this object's kept buffer when None)."""
        rows, dim = hidden_ND.shape
        train = hidden_ND.requires_grad
        self._reserve(chunk_rows)
        loss = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        grad_ND = torch.empty(rows, dim, dtype=torch.float32, device=hidden_ND.device) if train else None
        with torch.no_grad(), torch.autocast(hidden_ND.device.type, enabled=False):
            for start in range(0, rows, chunk_rows):
                hidden_nD = hidden_ND[start : start + chunk_rows].detach()
                labels_n = labels_N[start : start + chunk_rows]
                n = hidden_nD.shape[0]
                logits_nV, probs_nV = self._logits_CV[:n], self._probs_CV[:n]
                torch.mm(hidden_nD.to(self.weight_VD.dtype), self.weight_VD.t(), out=logits_nV)
                loss += self._chunk(logits_nV, probs_nV, labels_n, divisor, train)
                if train:
                    grad_ND[start : start + n] = logits_nV @ self.weight_VD
                    if self.weight.requires_grad:
                        self._add_weight_grad(probs_nV, hidden_nD.float())
        return loss, grad_ND

    def _reserve(self, chunk_rows: int) -> None:
        if self._probs_CV is None or self._probs_CV.shape[0] < chunk_rows:
            vocab = self.weight.shape[0]
            self._logits_CV = self.weight_VD.new_empty(chunk_rows, vocab)
            self._probs_CV = self.weight_VD.new_empty(chunk_rows, vocab, dtype=torch.float32)

    @staticmethod
    def _chunk(logits_nV, probs_nV, labels_n, divisor, train: bool) -> torch.Tensor:
        """The chunk's loss; with ``train``, the logits' gradient left in ``probs_nV`` (fp32) and in
        ``logits_nV`` (the compute dtype)."""
        trained_n = labels_n != IGNORE_INDEX
        label_n1 = labels_n.clamp(min=0)[:, None]
        probs_nV.copy_(logits_nV)
        probs_nV.sub_(probs_nV.amax(dim=-1, keepdim=True))
        picked_n = probs_nV.gather(1, label_n1)[:, 0]
        probs_nV.exp_()
        sum_n1 = probs_nV.sum(dim=-1, keepdim=True)
        loss = torch.where(trained_n, sum_n1[:, 0].log() - picked_n, 0.0).sum()
        share_n1 = trained_n[:, None].float()
        if divisor is not None:
            loss, share_n1 = loss / divisor, share_n1 / divisor
        if train:
            # Each trained row's share of the loss: the gradient is (softmax - one-hot) x share.
            probs_nV.mul_(share_n1 / sum_n1)
            probs_nV.scatter_add_(1, label_n1, -share_n1)
            logits_nV.copy_(probs_nV)
        return loss

    def _add_weight_grad(self, grad_nV: torch.Tensor, hidden_nD: torch.Tensor) -> None:
        grad_VD = self.weight.grad
        if grad_VD is not None:
            grad_VD.addmm_(grad_nV.t(), hidden_nD)
            return
        # The optimizer's ``zero_grad`` set the weight's gradient to None; its buffer is this one, written over.
        if self._weight_grad_VD is None:
            self._weight_grad_VD = torch.empty_like(self.weight)
        torch.mm(grad_nV.t(), hidden_nD, out=self._weight_grad_VD)
        self.weight.grad = self._weight_grad_VD
