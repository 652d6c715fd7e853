"""Block-sparse per-document attention against SDPA under the dense document mask: values and gradients over
random document layouts, with documents across block edges, rows that end in padding, and rows whose length is
not a multiple of the block."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from qwen3_titan_common.models.attention import document_causal_mask
from qwen3_titan_common.models.document_blocks import block_sparse_attention, document_blocks
from qwen3_titan_common.train.tolerance import assert_close_reduction, reduction_atol

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


def _bounds(q, k, v, grad_out, dtype) -> dict[str, tuple[int, float, float]]:
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


def _assert_close(actual, expected, bound, dtype, name):
    n_terms, abs_sum, atol = bound
    # Both sides also round a few elementwise steps (the exponential, the shift, the division): one term each.
    assert_close_reduction(actual, expected, [n_terms, 1, 1, 1], abs_sum, dtype=dtype, atol=atol, name=name)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("seq_len", [96, 101])
@pytest.mark.parametrize("path", ["CPU fused kernel", "plain ops"])
def test_values_and_gradients_equal_the_dense_document_mask(seed, seq_len, path):
    positions = _rows(seed, batch=3, seq_len=seq_len)
    blocks = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=7)
    assert len(blocks.chunks) > 1 and len(blocks.spans) > 1  # query blocks split across chunks and groups
    if path == "plain ops":  # what a device without the CPU's fused kernel runs (Neuron)
        blocks = dataclasses.replace(blocks, spans=())
    q, k, v = _inputs(seed, positions, torch.float64)
    ours = block_sparse_attention(q, k, v, blocks)
    dense = _dense(q, k, v, positions)
    grad_out = torch.randn_like(ours)
    bounds = _bounds(q, k, v, grad_out, torch.float64)
    _assert_close(ours, dense, bounds["out"], torch.float64, "out")
    grads = torch.autograd.grad(ours, (q, k, v), grad_out)
    dense_grads = torch.autograd.grad(dense, (q, k, v), grad_out)
    for name, ours_grad, dense_grad in zip("qkv", grads, dense_grads, strict=True):
        _assert_close(ours_grad, dense_grad, bounds[name], torch.float64, f"grad {name}")


def test_fp32_values_within_the_derived_bound_and_bf16_inputs_keep_their_dtype():
    positions = _rows(7, batch=2, seq_len=128)
    blocks = document_blocks(positions, block_size=BLOCK)
    q, k, v = _inputs(7, positions, torch.float32)
    exact = _dense(*(t.detach().double() for t in (q, k, v)), positions)
    ours = block_sparse_attention(q, k, v, blocks).detach().double()
    _assert_close(ours, exact, _bounds(q, k, v, q, torch.float32)["out"], torch.float32, "fp32 out")
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
    bounds = _bounds(q, k, v, grad_out, torch.float64)
    for name, a, b in zip(("out", "q", "k", "v"), *results, strict=True):
        _assert_close(a, b, bounds[name], torch.float64, name)
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
    bound = _bounds(q, k, v, q, torch.float64)["out"]
    _assert_close(
        block_sparse_attention(q, k, v, blocks), _dense(q, k, v, dense_positions), bound, torch.float64, "out"
    )
    # One document per row (from its start, or a continuation): plain causal attention, no block pairs.
    assert document_blocks(torch.arange(64).repeat(2, 1)) is None
    assert document_blocks(torch.arange(40, 104)[None]) is None
    with pytest.raises(ValueError, match="document blocks for 1 x 64, queries 1 x 32"):
        block_sparse_attention(q[:, :32], k[:, :32], v[:, :32], blocks)
    with pytest.raises(ValueError, match="positions must be"):
        document_blocks(positions[0])


@pytest.mark.parametrize("path", ["CPU fused kernel", "plain ops"])
def test_under_a_whole_model_ranks_bf16_autocast_the_attention_computes_as_on_bf16_inputs(path):
    # A one-CPU-rank job autocasts its forward to bf16 (models.fsdp_comms). The fused kernel then computes in
    # bf16, as causal SDPA does under autocast (fp32 inputs are cast); the plain-op path keeps its own
    # precision (fp32 accumulation) whatever autocast says.
    positions = _rows(3, batch=2, seq_len=128)
    blocks = document_blocks(positions, block_size=BLOCK)
    if path == "plain ops":
        blocks = dataclasses.replace(blocks, spans=())
    plain = [t.detach().bfloat16().requires_grad_() for t in _inputs(3, positions, torch.float32)]
    cast = _inputs(3, positions, torch.float32 if path == "CPU fused kernel" else torch.bfloat16)
    expected = block_sparse_attention(*plain, blocks)
    expected.sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block_sparse_attention(*cast, blocks)
    out.sum().backward()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    assert all(torch.equal(a.grad, b.grad.float()) for a, b in zip(cast, plain, strict=True))
