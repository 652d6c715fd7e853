"""The attention implementations ``--hf_v5.attention`` chooses between, as transformers names them.

``blocks`` (the default off CUDA) is :data:`DOCUMENT_BLOCKS`: common's block-sparse per-document attention
(``models.document_blocks``), registered in transformers' attention interface. The model's forward builds
the batch's block pairs once from the positions and passes them to every layer as the ``document_blocks``
keyword, which transformers hands through to the attention function; its mask function builds nothing.

Rows hold several documents, whose ``position_ids`` restart at 0 where each starts; transformers' mask
functions read those restarts (``masking_utils.find_packed_sequence_indices``) and build a block-causal
mask, so a token attends only to its own document. That needs no attention mask and no cache, which is
how the model is called (``model.py``).

``sdpa`` is :data:`DOCUMENT_SDPA`: transformers' own SDPA attention and SDPA mask function, registered
under a name of ours so that its mask is built at every call. transformers' ``"sdpa"`` decides per call
whether to build a 4D mask: none for a batch in which every row is one document, one otherwise, and
always one during a CUDA graph capture or under tracing (``_ignore_causal_mask_sdpa``). A compiled
decoder layer would then see a mask at one step and none at another, recompile, and fail torchtitan's
CUDA graph capture; with the mask always built, every call is alike (and on Neuron, one graph).

``flex`` is transformers' ``flex_attention``: a block mask from the same positions, CUDA only.
"""

from __future__ import annotations

import torch
from qwen3_titan_common.models import document_blocks as block_sparse
from qwen3_titan_common.models.context_parallel import ContextParallelBlocks, row_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DOCUMENT_SDPA = "qwen3_titan_document_sdpa"
DOCUMENT_BLOCKS = "qwen3_titan_document_blocks"
# The ``document_blocks`` keyword's default: nothing handed down, so the pairs come from ``position_ids``.
_FROM_POSITIONS = object()


def document_blocks_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    document_blocks=_FROM_POSITIONS,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Block-sparse per-document attention of ``(batch, heads, seq, head_dim)`` tensors, as transformers calls
    an attention function; ``(batch, seq, heads, head_dim)`` out. The block pairs come from the model's forward
    (``document_blocks``, None for one document per row) or, for a caller that hands none down, from
    ``position_ids``; None, or neither, is causal SDPA. Under context parallelism they are a CP rank's
    ``ContextParallelBlocks``: its queries against the whole row's keys and values, gathered here."""
    if document_blocks is _FROM_POSITIONS:
        document_blocks = None
        if position_ids is not None:
            document_blocks = block_sparse.document_blocks(position_ids.expand(query.shape[0], -1))
    if document_blocks is None:
        return sdpa_attention_forward(
            module, query, key, value, None, scaling=scaling, is_causal=True, **kwargs
        )
    q_BLHD, k_BLHD, v_BLHD = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if isinstance(document_blocks, ContextParallelBlocks):
        out_BLHD = row_attention(q_BLHD, k_BLHD, v_BLHD, document_blocks, scale=scaling)
    else:
        out_BLHD = block_sparse.block_sparse_attention(q_BLHD, k_BLHD, v_BLHD, document_blocks, scale=scaling)
    return out_BLHD.contiguous(), None


def no_mask(*args, **kwargs) -> None:
    """The mask function of :data:`DOCUMENT_BLOCKS`: the attention reads the block pairs, not a mask."""
    return None


def document_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention under the mask :func:`document_sdpa_mask` built."""
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def document_sdpa_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask (causal, within each packed document), never skipped for ``is_causal``."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(DOCUMENT_SDPA, document_sdpa_attention)
AttentionMaskInterface.register(DOCUMENT_SDPA, document_sdpa_mask)
AttentionInterface.register(DOCUMENT_BLOCKS, document_blocks_attention)
AttentionMaskInterface.register(DOCUMENT_BLOCKS, no_mask)

# --hf_v5.attention -> transformers' attn_implementation.
ATTENTION_IMPLEMENTATIONS = {"blocks": DOCUMENT_BLOCKS, "sdpa": DOCUMENT_SDPA, "flex": "flex_attention"}


def default_attention(device_type: str) -> str:
    """Block-sparse off CUDA; on CUDA transformers' SDPA under the packed mask (the block pairs are read on the
    host, which a CUDA graph cannot capture)."""
    return "sdpa" if device_type == "cuda" else "blocks"
