"""Packed-row attention cases shared by the block-sparse and the context-parallel attention tests: random
document layouts, q/k/v, the dense SDPA reference under the document mask, and the bounds (``train.tolerance``)
within which a result must equal it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from qwen3_titan_common.models.attention import document_causal_mask
from qwen3_titan_common.train.tolerance import assert_close_reduction, reduction_atol


def layout(generator: torch.Generator, seq_len: int, padding: int) -> list[int]:
    """Positions of one row: documents of 1-70 tokens, then ``padding`` tokens counting up as one document of
    their own (as ``data.packing`` pads a row)."""
    positions: list[int] = []
    while len(positions) < seq_len - padding:
        length = int(torch.randint(1, 70, (1,), generator=generator))
        positions += list(range(length))
    return positions[: seq_len - padding] + list(range(padding))


def rows(seed: int, batch: int, seq_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = [
        layout(generator, seq_len, padding=int(torch.randint(0, 40, (1,), generator=generator)))
        for _ in range(batch)
    ]
    # One document that spans a block edge, whatever the draw: tokens 10-29 of the first row.
    rows[0][10:30] = list(range(20))
    rows[0][30] = 0
    return torch.tensor(rows)


def inputs(
    seed: int, positions: torch.Tensor, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, dim: int = 16
):
    generator = torch.Generator().manual_seed(seed)
    batch, seq_len = positions.shape
    q = torch.randn(batch, seq_len, heads, dim, generator=generator, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, seq_len, kv_heads, dim, generator=generator, dtype=torch.float64).to(dtype)
    v = torch.randn(batch, seq_len, kv_heads, dim, generator=generator, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def dense_attention(q, k, v, positions):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=document_causal_mask(positions),
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def attention_bounds(q, k, v, grad_out, dtype) -> dict[str, tuple[int, float, float]]:
    """(reduction length, sum |terms|, error carried in) of the output and of each gradient, for the project's
    rule (``train.tolerance``). A score is a dim-term dot product of at most S = scale * dim * max|q| * max|k|,
    off by ds; a softmax weight moves by at most 2 * p * ds; the output sums at most seq weighted values
    (weights summing to 1). The backward: dp and delta are dim-term dot products of at most
    M = dim * max|dO| * max|v|, and dS = p * (dp - delta) errs by 2p * ds * 2M plus p times theirs; dq sums
    over keys (weights summing to 1), dk and dv over at most seq queries."""
    seq_len, dim = q.shape[1], q.shape[-1]
    scale = 1 / math.sqrt(dim)
    mq, mk, mv, mo = (t.detach().abs().amax().item() for t in (q, k, v, grad_out))
    score = reduction_atol(dim, scale * dim * mq * mk, dtype)
    m = dim * mo * mv
    ds = 4 * score * m + 2 * reduction_atol(dim, m, dtype)
    return {
        "out": (seq_len, mv, 2 * mv * score),
        "q": (seq_len, scale * mk * 2 * m, scale * mk * ds),
        "k": (seq_len, scale * mq * seq_len * 2 * m, scale * mq * seq_len * ds),
        "v": (seq_len, seq_len * mo, 2 * score * seq_len * mo),
    }


def assert_close(actual, expected, bound, dtype, name):
    n_terms, abs_sum, atol = bound
    # Both sides also round a few elementwise steps (the exponential, the shift, the division): one term each.
    assert_close_reduction(actual, expected, [n_terms, 1, 1, 1], abs_sum, dtype=dtype, atol=atol, name=name)
