"""The attention implementations ``--hf_v5.attention`` chooses between, as transformers names them.

``sdpa`` is :func:`causal_sdpa_attention`, registered with transformers' ``AttentionInterface``
under :data:`CAUSAL_SDPA`: transformers' own SDPA attention, always causal over the whole packed
row and never given a mask. That is what the native backend's SDPA computes, and why it is not
transformers' ``"sdpa"`` implementation itself: for that one, transformers decides per call
whether to build a 4D mask, and during a CUDA graph capture (and under tracing) it always builds
one (transformers 5.17 ``_ignore_causal_mask_sdpa``). A compiled decoder layer then sees no mask at
step 1 and a mask tensor inside torchtitan's capture at step 2, recompiles there and fails the
capture; an eager capture records the masked kernel, which cannot use the flash or cuDNN
kernels. An implementation transformers has no mask function for gets no mask at all
(``create_causal_mask`` returns None for it), so every call is alike.

``flex`` is transformers' ``flex_attention``: document masks from per-document positions, CUDA only.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CAUSAL_SDPA = "qwen3_titan_causal_sdpa"


def causal_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with ``is_causal=True`` and no mask (rows are packed, never padded)."""
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


AttentionInterface.register(CAUSAL_SDPA, causal_sdpa_attention)

# --hf_v5.attention -> transformers' attn_implementation.
ATTENTION_IMPLEMENTATIONS = {"sdpa": CAUSAL_SDPA, "flex": "flex_attention"}
