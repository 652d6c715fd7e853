"""Per-document attention for torchtitan's Qwen3: a token attends only to earlier tokens of its document.

Rows hold several documents (``data.packing``); their positions restart at 0 where each starts. On
CUDA the model uses torchtitan's own block-causal FlexAttention, whose mask torchtitan builds from
those positions. Flex has no CPU backward and Neuron runs SDPA, so elsewhere the inner attention is
:class:`DocumentCausalSDPA`: SDPA with a block-diagonal causal boolean mask, built inside the model
from a ``(batch, seq)`` document-id tensor. Both are fixed-shape inputs, so Neuron compiles one
graph for every batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

DocumentAttention = Literal["sdpa", "flex", "varlen"]


def document_ids(positions_BL: torch.Tensor) -> torch.Tensor:
    """Which document of its row each token belongs to: a new one wherever the position restarts at 0."""
    return torch.cumsum((positions_BL == 0).to(torch.int32), dim=1) - 1


def document_causal_mask(positions_BL: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, seq, seq)`` booleans: query ``i`` may attend key ``j`` when ``j <= i`` in one document.

    Built once per forward and shared by every layer (one ``seq x seq`` mask per row, not one per layer).
    The diagonal is always allowed, so no query row is fully masked and SDPA never returns NaN.
    """
    doc_BL = document_ids(positions_BL)
    seq_len = positions_BL.shape[1]
    causal_LL = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions_BL.device).tril()
    same_doc_BLL = doc_BL[:, :, None] == doc_BL[:, None, :]
    return (same_doc_BLL & causal_LL)[:, None]


class DocumentCausalSDPA(ScaledDotProductAttention):
    """torchtitan's SDPA inner attention, masked per document when the model passes a document mask.

    torchtitan's own SDPA refuses masks (it is causal only); this one takes the boolean mask that
    :func:`document_causal_mask` builds and is plain causal SDPA without one.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        # FLASH covers the CPU's fused kernel (which takes a mask); EFFICIENT is CUDA's kernel for masks.
        self.sdpa_backends = [
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.MATH,
        ]

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        if attention_masks is None:
            return ScaledDotProductAttention.forward(
                self, q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, is_causal=is_causal
            )
        if not isinstance(attention_masks, torch.Tensor) or attention_masks.dtype != torch.bool:
            raise TypeError(
                f"DocumentCausalSDPA takes a boolean (batch, 1, seq, seq) mask, got {type(attention_masks).__name__}"
            )
        q_BNLH, k_BNLH, v_BNLH = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            out_BNLH = F.scaled_dot_product_attention(
                q_BNLH, k_BNLH, v_BNLH, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        return out_BNLH.transpose(1, 2)


def inner_attention_config(kind: DocumentAttention):
    """The per-document inner attention of each kind: ours on SDPA, torchtitan's block-causal otherwise."""
    if kind == "sdpa":
        return DocumentCausalSDPA.Config()
    if kind == "flex":
        return FlexAttention.Config()
    if kind == "varlen":
        return VarlenAttention.Config()
    raise ValueError(f"attention {kind!r}: expected one of sdpa, flex, varlen")


def default_document_attention(device_kind: str) -> DocumentAttention:
    """torchtitan's block-causal Flex on CUDA (its default for language models); SDPA with a document
    mask on the CPU (Flex has no CPU backward) and on Neuron (which runs SDPA)."""
    return "flex" if device_kind == "cuda" else "sdpa"
