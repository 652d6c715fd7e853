"""The language-model loss of a CPU run: the output projection and cross-entropy of the trained tokens only.

A chat's system prompt and user turns are in the row but not trained (their labels are ignored): a third of
the tokens of typical chat data. Their logits are computed and thrown away by a plain loss, and on a CPU the
output projection at Qwen3's 151,936-token vocabulary is most of a small model's step. torchtitan's
:class:`ChunkedLossWrapper` already has the model return its hidden states (``_skip_lm_head``) and applies
``lm_head`` and the loss chunk by chunk, which also bounds the logits' memory; :class:`TrainedTokenLoss`
hands it only the trained positions' hidden states. The loss is the same sum over the same tokens divided by
the same count, so only the order of the fp32 sum differs from the plain loss.

On one CPU rank a dense model trains whole, fp32 weights under bf16 autocast (``models.fsdp_comms``); there
the projection and the cross-entropy are fused (``perf.projection``) in buffers kept across steps, the same
chunks' losses and gradients without autocast's fresh buffers of the logits' and the weight's size.

The selection has a shape that depends on the batch: not for Neuron (one graph per shape), CUDA graphs, or
the layouts whose hidden states are sharded along the vocabulary or split in stages (tensor and pipeline
parallelism), which take torchtitan's own chunked loss along the rows instead (:func:`loss_on_trained_tokens`):
on no layout are the logits at the vocabulary whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss

from qwen3_titan_common.perf.precision import compute_autocast
from qwen3_titan_common.perf.projection import ProjectionCrossEntropy


class TrainedTokenLoss(ChunkedLossWrapper):
    """torchtitan's chunked loss over the trained positions only (labels not ignored)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        num_chunks: int = 4
        """Chunks the trained tokens are split into (each one's logits are alive at a time)."""

    compute_dtype: torch.dtype | None = None
    """The autocast dtype of a model trained whole on one CPU rank (``models.fsdp_comms``), for the output
    projection this loss applies outside the model's forward; set by the trainer."""

    _kept_projection: ProjectionCrossEntropy | None = None

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # pred: the model's hidden states (batch, seq, dim); labels (batch, seq).
        trained_BL = labels != IGNORE_INDEX
        hidden_ND, labels_N = pred[trained_BL], labels[trained_BL]
        projection = None
        if type(self.loss_fn) is CrossEntropyLoss:  # which reads no ``loss_inputs`` (packed rows' positions)
            projection = ProjectionCrossEntropy.of(
                self.lm_head, self.compute_dtype, kept=self._kept_projection
            )
        if projection is None:
            return self._chunked_loss(hidden_ND, labels_N, global_valid_tokens, **loss_inputs)
        self._kept_projection = projection
        # Chunks sized by the batch, not by its trained tokens: the kept buffers fit every step.
        chunk_rows = max(1, -(-labels.numel() // self.num_chunks))
        loss, grad_ND = projection(hidden_ND, labels_N, chunk_rows=chunk_rows, divisor=global_valid_tokens)
        if grad_ND is None:
            return loss, {}
        return self._gradient_backprop(hidden_ND, grad_ND.to(hidden_ND.dtype), loss, self.lm_head, False), {}

    def _chunked_loss(self, hidden_ND, labels_N, global_valid_tokens, **loss_inputs):
        # Equal chunks (torchtitan's requirement), padded with ignored rows of zeros; at least one row each.
        padded = max(1, -(-labels_N.numel() // self.num_chunks)) * self.num_chunks
        missing = padded - labels_N.numel()
        if missing:
            hidden_ND = torch.cat([hidden_ND, hidden_ND.new_zeros(missing, hidden_ND.shape[-1])])
            labels_N = torch.cat([labels_N, labels_N.new_full((missing,), IGNORE_INDEX)])
        with compute_autocast(self.compute_dtype):
            return ChunkedLossWrapper.__call__(
                self, hidden_ND[None], labels_N[None], global_valid_tokens, **loss_inputs
            )


def trained_token_loss_applies(parallelism, device_type: str) -> bool:
    """Whether a run computes its loss on the trained tokens only: on the CPU, with every rank's hidden states
    whole along the vocabulary and its own share of the rows (no tensor or pipeline parallelism; context
    parallelism gives a rank whole tokens of its own, with their own labels)."""
    return (
        device_type == "cpu"
        and parallelism.tensor_parallel_degree == 1
        and parallelism.pipeline_parallel_degree == 1
    )


def loss_chunks(local_seq_len: int, wanted: int = 8) -> int:
    """Chunks of torchtitan's chunked loss for rows of ``local_seq_len`` tokens on a rank: the most, up to
    ``wanted``, that split them equally (its requirement, and one shape for Neuron's compiler)."""
    return max(n for n in range(1, wanted + 1) if local_seq_len % n == 0)


def loss_on_trained_tokens(loss, *, parallelism, seq_len: int, device_type: str):
    """The loss section with its plain cross-entropy applied chunk by chunk, so that the logits at the
    vocabulary are never whole (151,936 x 32k tokens would be 20 GB in fp32): on the trained tokens only where
    that applies (:func:`trained_token_loss_applies`), else torchtitan's :class:`ChunkedLossWrapper` along each
    rank's rows (fixed shapes, any layout). Any other loss (the router balance loss) is left as it is."""
    if type(loss) is not CrossEntropyLoss.Config:
        return loss
    if trained_token_loss_applies(parallelism, device_type):
        return TrainedTokenLoss.Config(loss_fn=loss)
    local = seq_len // max(1, parallelism.context_parallel_degree)
    return ChunkedLossWrapper.Config(loss_fn=loss, num_chunks=loss_chunks(local))
