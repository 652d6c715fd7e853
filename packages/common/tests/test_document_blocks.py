"""Block-sparse per-document attention against SDPA under the dense document mask: values and gradients over
random document layouts, with documents across block edges, rows that end in padding, and rows whose length is
not a multiple of the block."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from qwen3_titan_common.models.attention import document_causal_mask
from qwen3_titan_common.models.document_blocks import block_sparse_attention, document_blocks

BLOCK = 16


def _layout(generator: torch.Generator, seq_len: int, padding: int) -> list[int]:
    """Positions of one row: documents of 1-70 tokens, then ``padding`` tokens counting up as one document of
    their own (as ``data.packing`` pads a row)."""
    positions: list[int] = []
    while len(positions) < seq_len - padding:
        length = int(torch.randint(1, 70, (1,), generator=generator))
        positions += list(range(length))
    return positions[: seq_len - padding] + list(range(padding))


def _rows(seed: int, batch: int, seq_len: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = [
        _layout(generator, seq_len, padding=int(torch.randint(0, 40, (1,), generator=generator)))
        for _ in range(batch)
    ]
    # One document that spans a block edge, whatever the draw: tokens 10-29 of the first row.
    rows[0][10:30] = list(range(20))
    rows[0][30] = 0
    return torch.tensor(rows)


def _gamma(dtype: torch.dtype, terms: int) -> float:
    """Higham's bound on the relative error of a floating-point sum or dot product of ``terms`` terms."""
    unit = torch.finfo(dtype).eps / 2
    return terms * unit / (1 - terms * unit)


def _inputs(
    seed: int, positions: torch.Tensor, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, dim: int = 16
):
    generator = torch.Generator().manual_seed(seed)
    batch, seq_len = positions.shape
    q = torch.randn(batch, seq_len, heads, dim, generator=generator, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, seq_len, kv_heads, dim, generator=generator, dtype=torch.float64).to(dtype)
    v = torch.randn(batch, seq_len, kv_heads, dim, generator=generator, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _dense(q, k, v, positions):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=document_causal_mask(positions),
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def _output_bound(q, k, v, dtype) -> float:
    """How far two correct evaluations of softmax(q k^T / sqrt(d)) v in ``dtype`` can lie apart: each score's
    dot product of ``d`` terms errs by gamma_d times the sum of its terms' magnitudes, which perturbs each
    softmax weight by that relatively; the weighted sum over at most ``seq`` keys adds gamma_seq. Both sides
    err, hence the factor 2; the weights sum to 1, so each output is bounded by max |v|."""
    dim, seq_len = q.shape[-1], q.shape[1]
    score_terms = (q.detach().abs().amax() * k.detach().abs().amax() * dim / math.sqrt(dim)).item()
    return (
        2
        * v.detach().abs().amax().item()
        * (_gamma(dtype, dim) * score_terms * 2 + _gamma(dtype, seq_len + 4))
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("seq_len", [96, 101])
def test_values_and_gradients_equal_the_dense_document_mask(seed, seq_len):
    positions = _rows(seed, batch=3, seq_len=seq_len)
    blocks = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=7)
    assert len(blocks.chunks) > 1  # whole query blocks split across chunks
    q, k, v = _inputs(seed, positions, torch.float64)
    ours = block_sparse_attention(q, k, v, blocks)
    dense = _dense(q, k, v, positions)
    assert (ours - dense).abs().amax().item() <= _output_bound(q, k, v, torch.float64)
    grad_out = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (q, k, v), grad_out)
    dense_grads = torch.autograd.grad(dense, (q, k, v), grad_out)
    # Each gradient is a sum over at most seq terms of products of the forward's quantities with grad_out:
    # the forward's bound scaled by grad_out's size and the seq_len terms of that sum.
    scale = grad_out.abs().amax().item() * (q.abs().amax() + k.abs().amax() + v.abs().amax()).item()
    bound = _output_bound(q, k, v, torch.float64) * scale * seq_len
    for name, ours_grad, dense_grad in zip("qkv", grads, dense_grads, strict=True):
        assert (ours_grad - dense_grad).abs().amax().item() <= bound, name


def test_fp32_values_within_the_derived_bound_and_bf16_inputs_keep_their_dtype():
    positions = _rows(7, batch=2, seq_len=128)
    blocks = document_blocks(positions, block_size=BLOCK)
    q, k, v = _inputs(7, positions, torch.float32)
    exact = _dense(*(t.detach().double() for t in (q, k, v)), positions)
    assert (block_sparse_attention(q, k, v, blocks).double() - exact).abs().amax().item() <= _output_bound(
        q, k, v, torch.float32
    )
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out = block_sparse_attention(*low, blocks)
    out.sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)


def test_only_block_pairs_holding_an_allowed_pair_are_computed():
    positions = _rows(3, batch=2, seq_len=160)
    blocks = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=9)
    n = blocks.blocks_per_row
    mask = document_causal_mask(positions)[:, 0]  # (batch, seq, seq)
    needed = {
        (row * n + qb, row * n + kb)
        for row in range(2)
        for qb in range(n)
        for kb in range(n)
        if mask[row, qb * BLOCK : (qb + 1) * BLOCK, kb * BLOCK : (kb + 1) * BLOCK].any()
    }
    computed = [
        (int(q), int(k)) for chunk in blocks.chunks for q, k in zip(chunk.query_P, chunk.key_P, strict=True)
    ]
    assert sorted(computed) == sorted(needed)
    assert len(computed) < blocks.causal_pairs
    # Each query block's pairs are in one chunk, so its softmax completes there.
    owners = {}
    for index, chunk in enumerate(blocks.chunks):
        for q in chunk.query_P.tolist():
            assert owners.setdefault(q, index) == index


def test_fixed_shapes_pad_to_one_chunk_shape_and_a_power_of_two_chunks_with_the_same_numbers():
    positions = _rows(5, batch=2, seq_len=160)
    exact = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=12)
    fixed = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=12, fixed_shapes=True)
    assert {chunk.query_P.numel() for chunk in fixed.chunks} == {12}
    assert math.log2(len(fixed.chunks)).is_integer() and len(fixed.chunks) >= len(exact.chunks)
    q, k, v = _inputs(5, positions, torch.float64)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    results = []
    for blocks in (exact, fixed):
        out = block_sparse_attention(q, k, v, blocks)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    bound = _output_bound(q, k, v, torch.float64) * 160 * grad_out.abs().amax().item() * 10
    for a, b in zip(*results, strict=True):
        assert (a - b).abs().amax().item() <= bound
    # Whatever the documents, one chunk shape (even where a long document needs more pairs than asked for
    # a chunk: 12 blocks a row here) and a handful of chunk counts.
    shapes = set()
    for seed in range(8):
        layout = document_blocks(
            _rows(seed, batch=2, seq_len=192), block_size=BLOCK, pairs_per_chunk=4, fixed_shapes=True
        )
        shapes |= {tuple(chunk.allowed_PQK.shape) for chunk in layout.chunks}
        assert math.log2(len(layout.chunks)).is_integer()
    assert shapes == {(12, BLOCK, BLOCK)}


def test_a_row_that_begins_inside_a_document_and_bad_shapes():
    # No position 0 first: the row's leading tokens are one document (a text stream's continuation).
    positions = torch.tensor([list(range(40, 80)) + list(range(24))])
    q, k, v = _inputs(0, positions, torch.float64)
    blocks = document_blocks(positions, block_size=BLOCK)
    dense_positions = torch.tensor([list(range(40)) + list(range(24))])  # the same documents, restarted
    assert (block_sparse_attention(q, k, v, blocks) - _dense(q, k, v, dense_positions)).abs().amax() <= (
        _output_bound(q, k, v, torch.float64)
    )
    # One document per row (from its start, or a continuation): plain causal attention, no block pairs.
    assert document_blocks(torch.arange(64).repeat(2, 1)) is None
    assert document_blocks(torch.arange(40, 104)[None]) is None
    with pytest.raises(ValueError, match="document blocks for 1 x 64, queries 1 x 32"):
        block_sparse_attention(q[:, :32], k[:, :32], v[:, :32], blocks)
    with pytest.raises(ValueError, match="positions must be"):
        document_blocks(positions[0])
