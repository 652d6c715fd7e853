"""The attention implementations ``--hf_v5.attention`` chooses between, as transformers names them.

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
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

DOCUMENT_SDPA = "qwen3_titan_document_sdpa"


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

# --hf_v5.attention -> transformers' attn_implementation.
ATTENTION_IMPLEMENTATIONS = {"sdpa": DOCUMENT_SDPA, "flex": "flex_attention"}
