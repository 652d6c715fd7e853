"""Per-document attention for torchtitan's Qwen3: a token attends only to earlier tokens of its document.

Rows hold several documents (``data.packing``); their positions restart at 0 where each starts. On
CUDA the model uses torchtitan's own block-causal FlexAttention, whose mask torchtitan builds from
those positions. Flex has no CPU backward and Neuron runs neither Flex nor varlen, so elsewhere the
inner attention is :class:`DocumentBlockAttention`: only the blocks of the score matrix that hold a
same-document, causal pair are computed (``models.document_blocks``), from block pairs the model
builds once per forward from the positions. Without positions it is plain causal SDPA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
from torchtitan.tools.logging import logger

from qwen3_titan_common.models.context_parallel import (
    ContextParallelBlocks,
    block_size_for,
    chunk_size,
    row_attention,
)
from qwen3_titan_common.models.document_blocks import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_PAIRS_PER_CHUNK,
    DocumentBlocks,
    block_sparse_attention,
    document_blocks,
    segments_of,
)

DocumentAttention = Literal["blocks", "flex", "varlen"]


def document_ids(positions_BL: torch.Tensor) -> torch.Tensor:
    """Which document of its row each token belongs to: a new one wherever the position restarts at 0."""
    return torch.cumsum((positions_BL == 0).to(torch.int32), dim=1) - 1


def document_causal_mask(positions_BL: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, seq, seq)`` booleans: query ``i`` may attend key ``j`` when ``j <= i`` in one document.

    The dense form of what :class:`DocumentBlockAttention` computes: SDPA under it is the reference the
    block-sparse attention is tested and benchmarked against. The diagonal is always allowed, so no query
    row is fully masked and SDPA never returns NaN.
    """
    doc_BL = document_ids(positions_BL)
    seq_len = positions_BL.shape[1]
    causal_LL = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions_BL.device).tril()
    same_doc_BLL = doc_BL[:, :, None] == doc_BL[:, None, :]
    # A continuation (a segment starting at a position p > 0, ``models.document_blocks``) sees its document's
    # positions below p and its own segment only.
    segment_BL, start_BL = segments_of(positions_BL)
    visible_BLL = (segment_BL[:, :, None] == segment_BL[:, None, :]) | (
        positions_BL[:, None, :] < start_BL[:, :, None]
    )
    return (same_doc_BLL & causal_LL & visible_BLL)[:, None]


class DocumentBlockAttention(ScaledDotProductAttention):
    """torchtitan's SDPA inner attention, per document and block-sparse when the model passes the batch's
    :class:`DocumentBlocks` as its attention masks; plain causal SDPA without them (one document per row).
    Under context parallelism the masks are a CP rank's :class:`ContextParallelBlocks`
    (``models.context_parallel``): its queries against the row's keys and values, gathered here."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        block_size: int = DEFAULT_BLOCK_SIZE
        """Queries and keys per block."""

        pairs_per_chunk: int = DEFAULT_PAIRS_PER_CHUNK
        """Block pairs computed at once (bounds the transient score buffer)."""

        fixed_shapes: bool = False
        """Pad the block pairs to a handful of shapes (Neuron compiles one graph per shape)."""

        def document_blocks(self, positions_BL: torch.Tensor) -> DocumentBlocks | None:
            """The block pairs of a batch, built once per forward and passed to every layer (None: one
            document per row, plain causal attention)."""
            return document_blocks(
                positions_BL,
                block_size=self.block_size,
                pairs_per_chunk=self.pairs_per_chunk,
                fixed_shapes=self.fixed_shapes,
            )

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: DocumentBlocks | ContextParallelBlocks | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        if attention_masks is None:
            return ScaledDotProductAttention.forward(
                self, q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal
            )
        if isinstance(attention_masks, ContextParallelBlocks):
            return row_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks, scale=scale)
        if not isinstance(attention_masks, DocumentBlocks):
            raise TypeError(
                f"DocumentBlockAttention takes the batch's DocumentBlocks, got {type(attention_masks).__name__}"
            )
        return block_sparse_attention(q_BLNH, k_BLNH, v_BLNH, attention_masks, scale=scale)


def inner_attention_config(kind: DocumentAttention, *, fixed_shapes: bool = False):
    """The per-document inner attention of each kind: ours block-sparse, torchtitan's block-causal otherwise."""
    if kind == "blocks":
        return DocumentBlockAttention.Config(fixed_shapes=fixed_shapes)
    if kind == "flex":
        return FlexAttention.Config()
    if kind == "varlen":
        return VarlenAttention.Config()
    raise ValueError(f"attention {kind!r}: expected one of blocks, flex, varlen")


def default_document_attention(device_kind: str) -> DocumentAttention:
    """torchtitan's block-causal Flex on CUDA (its default for language models); block-sparse attention on
    the CPU (Flex has no CPU backward) and on Neuron (no Flex or varlen there)."""
    return "flex" if device_kind == "cuda" else "blocks"


def document_attention_of(model_config):
    """The block-sparse per-document attention settings (``DocumentBlockAttention.Config``) a model config
    computes with, or None: a torchtitan decoder's inner attention, or what a model config of another kind
    says through its own ``document_attention()`` (hf-v5's transformers model)."""
    own = getattr(model_config, "document_attention", None)
    if callable(own):
        return own()
    inner = getattr(getattr(model_config, "first_attention", None), "inner_attention", None)
    return inner if isinstance(inner, DocumentBlockAttention.Config) else None


def uses_document_blocks(model_config) -> bool:
    """Whether a model config's attention is our block-sparse per-document attention."""
    return document_attention_of(model_config) is not None


def parallelism_for_document_cp(parallelism, *, model_config, seq_len: int):
    """The parallelism section set up for context parallelism over our attention, where it asks for CP (else
    itself).

    The CP split is ours (the trainer's and validator's ``post_dataloading_process``) and the gather is the
    attention's own, so the model is parallelised on torchtitan's ``partial_dtensor`` path
    (``models.context_parallel.parallelize_decoder``): its default ``spmd_types`` path refuses context
    parallelism for any attention but Flex."""
    attention = document_attention_of(model_config)
    degree = parallelism.context_parallel_degree
    if degree <= 1 or attention is None or seq_len % (2 * degree):
        return parallelism  # a row that does not split is refused by the run's checks (train.preflight)
    logger.info(
        f"[layout] context parallel {degree}: each row of {seq_len} tokens in {2 * degree} chunks of "
        f"{chunk_size(seq_len, degree)}, CP rank r holding chunks r and {2 * degree - 1}-r; keys and values "
        f"gathered in each layer, block-sparse per document in blocks of "
        f"{block_size_for(seq_len, degree, attention.block_size)}"
    )
    if parallelism.spmd_backend == "partial_dtensor":
        return parallelism
    return dataclasses.replace(parallelism, spmd_backend="partial_dtensor")
