"""Block-sparse per-document attention against SDPA under the dense document mask: values and gradients over
random document layouts, with documents across block edges, rows that end in padding, and rows whose length is
not a multiple of the block."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from qwen3_titan_common.models.attention import document_causal_mask
from qwen3_titan_common.models.document_blocks import (
    DocumentBlocks,
    block_sparse_attention,
    document_blocks,
    document_ranges,
)
from qwen3_titan_testing.attention_cases import assert_close, attention_bounds, dense_attention, inputs, rows

BLOCK = 16
PATHS = ["CPU fused kernel", "plain ops", "per-document calls"]


def _on_path(blocks: DocumentBlocks, positions: torch.Tensor, path: str) -> DocumentBlocks:
    """``blocks`` computed the way ``path`` names, whatever the documents' lengths would choose."""
    if path == "plain ops":  # what a device without the CPU's fused kernel runs (Neuron)
        return dataclasses.replace(blocks, spans=())
    if path == "per-document calls":  # the CPU's path for long documents
        return dataclasses.replace(blocks, documents=document_ranges(positions))
    return blocks


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("seq_len", [96, 101])
@pytest.mark.parametrize("path", PATHS)
def test_values_and_gradients_equal_the_dense_document_mask(seed, seq_len, path):
    positions = rows(seed, batch=3, seq_len=seq_len)
    blocks = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=7, per_document=False)
    assert len(blocks.chunks) > 1 and len(blocks.spans) > 1  # query blocks split across chunks and groups
    blocks = _on_path(blocks, positions, path)
    q, k, v = inputs(seed, positions, torch.float64)
    ours = block_sparse_attention(q, k, v, blocks)
    dense = dense_attention(q, k, v, positions)
    grad_out = torch.randn_like(ours)
    bounds = attention_bounds(q, k, v, grad_out, torch.float64)
    assert_close(ours, dense, bounds["out"], torch.float64, "out")
    grads = torch.autograd.grad(ours, (q, k, v), grad_out)
    dense_grads = torch.autograd.grad(dense, (q, k, v), grad_out)
    for name, ours_grad, dense_grad in zip("qkv", grads, dense_grads, strict=True):
        assert_close(ours_grad, dense_grad, bounds[name], torch.float64, f"grad {name}")


def test_fp32_values_within_the_derived_bound_and_bf16_inputs_keep_their_dtype():
    positions = rows(7, batch=2, seq_len=128)
    blocks = document_blocks(positions, block_size=BLOCK)
    q, k, v = inputs(7, positions, torch.float32)
    exact = dense_attention(*(t.detach().double() for t in (q, k, v)), positions)
    ours = block_sparse_attention(q, k, v, blocks).detach().double()
    assert_close(ours, exact, attention_bounds(q, k, v, q, torch.float32)["out"], torch.float32, "fp32 out")
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out = block_sparse_attention(*low, blocks)
    out.sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)


def test_only_block_pairs_holding_an_allowed_pair_are_computed():
    positions = rows(3, batch=2, seq_len=160)
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
    positions = rows(5, batch=2, seq_len=160)
    exact = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=12)
    fixed = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=12, fixed_shapes=True)
    assert {chunk.query_P.numel() for chunk in fixed.chunks} == {12}
    assert math.log2(len(fixed.chunks)).is_integer() and len(fixed.chunks) >= len(exact.chunks)
    q, k, v = inputs(5, positions, torch.float64)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    results = []
    for blocks in (exact, fixed):
        out = block_sparse_attention(q, k, v, blocks)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    bounds = attention_bounds(q, k, v, grad_out, torch.float64)
    for name, a, b in zip(("out", "q", "k", "v"), *results, strict=True):
        assert_close(a, b, bounds[name], torch.float64, name)
    # Whatever the documents, one chunk shape (even where a long document needs more pairs than asked for
    # a chunk: 12 blocks a row here) and a handful of chunk counts.
    shapes = set()
    for seed in range(8):
        layout = document_blocks(
            rows(seed, batch=2, seq_len=192), block_size=BLOCK, pairs_per_chunk=4, fixed_shapes=True
        )
        shapes |= {tuple(chunk.allowed_PQK.shape) for chunk in layout.chunks}
        assert math.log2(len(layout.chunks)).is_integer()
    assert shapes == {(12, BLOCK, BLOCK)}


def test_long_documents_take_one_call_each_and_short_ones_the_block_pairs():
    # Documents of 64 blocks and more in a row: one causal SDPA call each, ranges in the row's token order, the
    # leading tail of a document that began in an earlier row its own range.
    tail_then_two = torch.tensor([list(range(100, 1124)) + list(range(2048)) + list(range(1024))])
    long = document_blocks(tail_then_two, block_size=BLOCK)
    assert long.documents == (((0, 1024), (1024, 3072), (3072, 4096)),) and not long.chunks
    # Documents of 2 blocks: the block pairs.
    short = torch.arange(2 * BLOCK).repeat(1, 8)
    assert document_blocks(short, block_size=BLOCK).documents is None
    assert document_ranges(short) == (
        tuple((start, start + 2 * BLOCK) for start in range(0, 16 * BLOCK, 2 * BLOCK)),
    )


def test_a_row_that_begins_inside_a_document_and_bad_shapes():
    # No position 0 first: the row's leading tokens are one document (a text stream's continuation).
    positions = torch.tensor([list(range(40, 80)) + list(range(24))])
    q, k, v = inputs(0, positions, torch.float64)
    blocks = document_blocks(positions, block_size=BLOCK)
    dense_positions = torch.tensor([list(range(40)) + list(range(24))])  # the same documents, restarted
    bound = attention_bounds(q, k, v, q, torch.float64)["out"]
    assert_close(
        block_sparse_attention(q, k, v, blocks),
        dense_attention(q, k, v, dense_positions),
        bound,
        torch.float64,
        "out",
    )
    # One document per row (from its start, or a continuation): plain causal attention, no block pairs.
    assert document_blocks(torch.arange(64).repeat(2, 1)) is None
    assert document_blocks(torch.arange(40, 104)[None]) is None
    with pytest.raises(ValueError, match="document blocks for 1 x 64 queries over 64 keys, got 1 x 32"):
        block_sparse_attention(q[:, :32], k[:, :32], v[:, :32], blocks)
    with pytest.raises(ValueError, match="positions must be"):
        document_blocks(positions[0])


@pytest.mark.parametrize("path", PATHS)
def test_under_a_whole_model_ranks_bf16_autocast_the_attention_computes_as_on_bf16inputs(path):
    # A one-CPU-rank job autocasts its forward to bf16 (models.fsdp_comms). The fused kernel then computes in
    # bf16, as causal SDPA does under autocast (fp32 inputs are cast); the plain-op path keeps its own
    # precision (fp32 accumulation) whatever autocast says.
    positions = rows(3, batch=2, seq_len=128)
    blocks = _on_path(document_blocks(positions, block_size=BLOCK, per_document=False), positions, path)
    plain = [t.detach().bfloat16().requires_grad_() for t in inputs(3, positions, torch.float32)]
    cast = inputs(3, positions, torch.bfloat16 if path == "plain ops" else torch.float32)
    expected = block_sparse_attention(*plain, blocks)
    expected.sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block_sparse_attention(*cast, blocks)
    out.sum().backward()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    assert all(torch.equal(a.grad, b.grad.float()) for a, b in zip(cast, plain, strict=True))


def _with_continuations(positions: torch.Tensor) -> torch.Tensor:
    """``positions`` with a preference pair's layout written into each row: a prompt of 13 tokens and a chosen
    completion of 20 (positions 0-32), then the rejected completion continuing the prompt (positions 12-37),
    across block edges."""
    rows_ = positions.clone()
    rows_[:, 5:38] = torch.arange(33)
    rows_[:, 38:64] = torch.arange(12, 38)
    rows_[:, 64] = 0
    return rows_


@pytest.mark.parametrize("path", PATHS[:2])
def test_a_continuation_attends_its_prompt_and_itself(path):
    positions = _with_continuations(rows(5, batch=2, seq_len=101))
    mask = document_causal_mask(positions)[0, 0]
    # The rejected completion's first query (the prompt's last token again) sees the prompt's first 12 tokens
    # and itself, not the chosen completion.
    assert mask[38].nonzero().flatten().tolist() == [*range(5, 17), 38]
    assert not mask[38:64, 17:38].any() and mask[37, 5:38].all()
    blocks = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=7)
    assert blocks.documents is None  # a continuation is never one causal call per document
    blocks = _on_path(blocks, positions, path)
    q, k, v = inputs(5, positions, torch.float64)
    ours = block_sparse_attention(q, k, v, blocks)
    dense = dense_attention(q, k, v, positions)
    grad_out = torch.randn_like(ours)
    bounds = attention_bounds(q, k, v, grad_out, torch.float64)
    assert_close(ours, dense, bounds["out"], torch.float64, "out")
    for name, ours_grad, dense_grad in zip(
        "qkv",
        torch.autograd.grad(ours, (q, k, v), grad_out),
        torch.autograd.grad(dense, (q, k, v), grad_out),
        strict=True,
    ):
        assert_close(ours_grad, dense_grad, bounds[name], torch.float64, f"grad {name}")
    fixed = document_blocks(positions, block_size=BLOCK, pairs_per_chunk=7, fixed_shapes=True)
    assert_close(block_sparse_attention(q, k, v, fixed), dense, bounds["out"], torch.float64, "fixed shapes")
