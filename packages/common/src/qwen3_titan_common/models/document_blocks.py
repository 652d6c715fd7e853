"""Block-sparse per-document attention: only the blocks of the score matrix where a token can see an earlier
token of its own document are computed.

A packed row holds documents side by side, their positions restarting at 0 where each starts. The row is cut
into blocks of ``block_size`` queries and keys. Documents are contiguous, so a query block needs exactly the key
blocks from the one where the document of its first token starts up to itself; every other block of the score
matrix is masked whole and is never computed. Inside the blocks that are computed, a pair ``(query, key)``
counts when both tokens are of one document and the key is not later than the query (the partial blocks on
each document's diagonal and at its edges).

A document may hold a continuation: a segment whose positions do not go on from the token before it and do not
restart at 0, but start at some ``p > 0``. Its tokens share the document's first ``p`` positions with the segment
the document started with, and attend to those and to their own segment only: a preference pair whose rejected
completion shares the chosen one's prompt (``data.preference``), computed once. So in general a query may attend
a key of its document no later than itself when the key is of its own segment, or the key's position is below
where the query's segment starts. Without continuations that is the rule above.

On the CPU, where a batch's documents are long (on average at least ``PER_DOCUMENT_BLOCKS`` blocks), each
document is one call of torch's causal SDPA on its own tokens (the fused kernel causal SDPA runs on a whole
row): its work is the documents' own triangles, with no block padding and no mask, and a handful of calls a
row. Measured on a 2-core CPU (one layer's forward and backward, bf16): documents of 1-4k tokens in a 16k row
0.56 s against the block pairs' 1.06 s and causal SDPA's 2.76 s; documents of 16-48 tokens 0.79 s against the
block pairs' 0.13 s (521 calls); equal at documents of 100-300 tokens (16 heads of 128).

Otherwise, on the CPU the query blocks are grouped by how many key blocks they need, and each group is one call of
torch's fused CPU attention kernel (the one causal SDPA runs): a group's query blocks against their gathered
key spans under an additive mask of the span's disallowed pairs. The kernel accumulates in fp32 whatever its
inputs, so bf16 inputs (a CPU rank under bf16 autocast, where causal SDPA computes in bf16 too) keep bf16's
GEMM speed. The forward keeps each query's output and log-sum-exp, the backward gathers the key spans again
(only the layer's own inputs are saved, as SDPA saves them).

Elsewhere (Neuron, or ``fixed_shapes`` anywhere) the block pairs are computed as flash attention is, in plain
tensor ops: the forward keeps each query's output and log-sum-exp, the backward recomputes the scores of each
block pair. Block pairs go in chunks of whole query blocks (so each query's softmax is complete inside one
chunk) of at most ``pairs_per_chunk`` pairs, which bounds the transient score buffer whatever the documents'
lengths. The scores and the softmax are in fp32 at least (bf16 inputs are upcast, as SDPA's kernels
accumulate).

With ``fixed_shapes`` (Neuron, which compiles one graph per input shape) every chunk is padded to
``pairs_per_chunk`` pairs with pairs that are masked whole, and the number of chunks to a power of two: a
batch's graph then takes one of a handful of shapes, whatever its documents.

Hand-written because nothing in torch or torchtitan does this off CUDA: FlexAttention's block mask skips
empty blocks only on CUDA (its CPU path has no backward), and SDPA takes a dense ``seq x seq`` mask, under
which its CPU kernel computes every block, the masked ones included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qwen3_titan_common.compat import cpu_flash_attention, cpu_flash_attention_backward

DEFAULT_BLOCK_SIZE = 64
# Score buffer of one chunk: pairs x heads x block^2 x 4 bytes, 8 MiB for 32 pairs of 64 x 64 at 16 heads.
# Measured on a 2-core CPU (seq 2048, 16 heads of 128, chats of ~300 tokens): 32 pairs a chunk 0.29 s a
# layer's forward and backward, 256 pairs 0.56 s (buffers past the allocator's reuse, and the caches).
DEFAULT_PAIRS_PER_CHUNK = 32
# A batch whose documents average at least this many blocks runs one causal SDPA call per document on the CPU
# (module docstring): 256 tokens at the default block, where the two paths measured equal.
PER_DOCUMENT_BLOCKS = 4


@dataclass(frozen=True)
class BlockChunk:
    """Block pairs computed together: whole query blocks, so their softmax completes within the chunk."""

    query_P: torch.Tensor
    """(pairs,) flat query-block index (batch x blocks; the extra last index is the discard block of padding pairs)."""
    key_P: torch.Tensor
    """(pairs,) flat key-block index."""
    allowed_PQK: torch.Tensor
    """(pairs, block, block) booleans: the query may attend the key (same document, not later)."""


@dataclass(frozen=True)
class SpanGroup:
    """Query blocks whose keys span the same number of blocks: one call of the CPU's fused kernel."""

    query_G: torch.Tensor
    """(queries,) flat query-block index (batch x blocks)."""
    key_GS: torch.Tensor
    """(queries, span) flat token index (batch x padded seq) of each query block's contiguous keys."""
    allowed_GbS: torch.Tensor
    """(queries, block, span) booleans: the query may attend the key (same document, not later)."""

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """(queries, 1, block, span) additive mask: 0 where allowed, -inf elsewhere."""
        zeros = torch.zeros(self.allowed_GbS.shape, dtype=dtype, device=self.allowed_GbS.device)
        return zeros.masked_fill_(~self.allowed_GbS, -math.inf)[:, None]


@dataclass(frozen=True)
class DocumentBlocks:
    """The block pairs of one batch, built once per forward from its positions and shared by every layer."""

    batch: int
    seq_len: int
    """Queries per row."""
    block_size: int
    chunks: tuple[BlockChunk, ...]
    spans: tuple[SpanGroup, ...] = ()
    """The same pairs grouped for the CPU's fused kernel; empty with fixed shapes."""
    key_len: int | None = None
    """Keys per row where they are more than the queries (context parallelism: a rank's queries are some of
    the row's blocks, its keys the whole row); None: the queries' row."""
    documents: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """Each row's documents as (start, end) token ranges, where the CPU computes one causal SDPA call per
    document (long documents, :data:`PER_DOCUMENT_BLOCKS`; then there are no block pairs); None: the block
    pairs."""

    @property
    def blocks_per_row(self) -> int:
        """Query blocks per row."""
        return -(-self.seq_len // self.block_size)

    @property
    def keys_per_row(self) -> int:
        return self.seq_len if self.key_len is None else self.key_len

    @property
    def key_blocks_per_row(self) -> int:
        return -(-self.keys_per_row // self.block_size)

    @property
    def num_pairs(self) -> int:
        """Block pairs computed, padding pairs included."""
        return sum(int(chunk.query_P.numel()) for chunk in self.chunks)

    @property
    def causal_pairs(self) -> int:
        """Block pairs plain causal attention computes over the same rows (for comparison)."""
        n = self.blocks_per_row
        return self.batch * n * (n + 1) // 2


def document_blocks(
    positions_BL: torch.Tensor,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    pairs_per_chunk: int = DEFAULT_PAIRS_PER_CHUNK,
    fixed_shapes: bool = False,
    query_blocks: torch.Tensor | None = None,
    per_document: bool = True,
) -> DocumentBlocks | None:
    """The block pairs of ``(batch, seq)`` positions that restart at 0 where each document starts; None when
    every row is one document, where plain causal attention is the same and its fused kernel is faster.

    A row that begins inside a document (no 0 first) holds that document's tail as its first one.

    ``query_blocks``: the row's block indices whose queries are computed, in the order the queries are held
    (context parallelism: a rank's share of the row, ``models.context_parallel``); the keys are then the whole
    row, and the pairs are built even for rows of one document (the queries are not the keys' row).

    On the CPU a batch of long documents (:data:`PER_DOCUMENT_BLOCKS`) gets its documents' ranges and no block
    pairs, which it does not need (building them is a few percent of a short row's step); ``per_document``
    False builds the block pairs whatever the documents.
    """
    if positions_BL.dim() != 2:
        raise ValueError(f"positions must be (batch, seq), got shape {tuple(positions_BL.shape)}")
    batch, seq_len = positions_BL.shape
    device = positions_BL.device
    n = -(-seq_len // block_size)
    padded = n * block_size
    starts_BL = (positions_BL == 0).to(torch.int64)
    continued = has_continuations(positions_BL)
    if query_blocks is None and not bool(starts_BL[:, 1:].any()) and not continued:
        return None
    per_document = per_document and not continued
    if per_document and query_blocks is None and not fixed_shapes and device.type == "cpu":
        documents = document_ranges(positions_BL)
        if batch * seq_len >= PER_DOCUMENT_BLOCKS * block_size * sum(map(len, documents)):
            return DocumentBlocks(
                batch=batch, seq_len=seq_len, block_size=block_size, chunks=(), documents=documents
            )
    segments = _Segments.of(positions_BL, padded, continued)
    token_L = torch.arange(seq_len, device=device)
    # Each token's document: how many documents started up to it; the block padding past seq_len is -1, a
    # document of its own that no real query shares.
    doc_BL = torch.full((batch, padded), -1, dtype=torch.int64, device=device)
    doc_BL[:, :seq_len] = torch.cumsum(starts_BL, dim=1)
    # Where each token's document starts (0 for a row's leading tail).
    first_BL = torch.cummax(torch.where(starts_BL.bool(), token_L, 0), dim=1).values
    queries_q = torch.arange(n, device=device) if query_blocks is None else query_blocks.to(device)
    if queries_q.numel() and (int(queries_q.min()) < 0 or int(queries_q.max()) >= n):
        raise ValueError(f"query blocks {queries_q.tolist()} outside a row of {n} blocks")
    row_Bq = torch.arange(batch, device=device)[:, None] * n
    low_Bq = first_BL[:, queries_q * block_size] // block_size
    count_Q = (queries_q - low_Bq + 1).flatten()
    # Flat key-block indices (batch x key blocks): each query block's own, and the first its keys need.
    block_Q = (queries_q + row_Bq).flatten()
    low_Q = (low_Bq + row_Bq).flatten()
    counts = count_Q.tolist()
    # A query block's pairs always fit one chunk; with fixed shapes, whatever the batch (at most a row's blocks).
    pairs_per_chunk = max(pairs_per_chunk, n if fixed_shapes else max(counts))

    num_query = count_Q.numel()
    doc_T = doc_BL.flatten()
    offset_b = torch.arange(block_size, device=device)
    chunks: list[BlockChunk] = []
    begin = 0
    while begin < num_query:
        end, pairs = begin, 0
        while end < num_query and pairs + counts[end] <= pairs_per_chunk:
            pairs += counts[end]
            end += 1
        query_P = torch.arange(begin, end, device=device).repeat_interleave(count_Q[begin:end])
        first_of_query = torch.cumsum(count_Q[begin:end], 0) - count_Q[begin:end]
        step_P = torch.arange(pairs, device=device) - first_of_query.repeat_interleave(count_Q[begin:end])
        key_P = low_Q[query_P] + step_P
        # Flat token indices in the keys' rows: a pair's query and key are in one row, so order is causality.
        query_tok = block_Q[query_P][:, None] * block_size + offset_b
        key_tok = key_P[:, None] * block_size + offset_b
        allowed_PQK = segments.allowed(doc_T, query_tok, key_tok)
        if fixed_shapes and pairs < pairs_per_chunk:
            missing = pairs_per_chunk - pairs
            query_P = torch.cat([query_P, torch.full((missing,), num_query, device=device)])
            key_P = torch.cat([key_P, torch.zeros(missing, dtype=torch.int64, device=device)])
            allowed_PQK = torch.cat(
                [allowed_PQK, torch.zeros(missing, block_size, block_size, dtype=torch.bool, device=device)]
            )
        chunks.append(BlockChunk(query_P, key_P, allowed_PQK))
        begin = end
    if fixed_shapes:
        empty = BlockChunk(
            torch.full((pairs_per_chunk,), num_query, device=device),
            torch.zeros(pairs_per_chunk, dtype=torch.int64, device=device),
            torch.zeros(pairs_per_chunk, block_size, block_size, dtype=torch.bool, device=device),
        )
        chunks.extend([empty] * (2 ** math.ceil(math.log2(len(chunks))) - len(chunks)))
    spans = () if fixed_shapes else _span_groups(doc_T, segments, block_Q, low_Q, count_Q, block_size)
    if query_blocks is None:
        return DocumentBlocks(
            batch=batch, seq_len=seq_len, block_size=block_size, chunks=tuple(chunks), spans=spans
        )
    return DocumentBlocks(
        batch=batch,
        seq_len=int(queries_q.numel()) * block_size,
        block_size=block_size,
        chunks=tuple(chunks),
        spans=spans,
        key_len=seq_len,
    )


def segment_starts(positions_BL: torch.Tensor) -> torch.Tensor:
    """``(batch, seq)`` booleans: where a segment starts, its positions not going on from the token before (a
    row's first token, a document's restart at 0, a continuation)."""
    starts_BL = torch.ones_like(positions_BL, dtype=torch.bool)
    starts_BL[:, 1:] = positions_BL[:, 1:] != positions_BL[:, :-1] + 1
    return starts_BL


def segments_of(positions_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's segment, numbered from 1 in its row, and the position its segment starts at: ``(batch, seq)``
    each. A continuation sees its document's positions below its start, and its own segment."""
    starts_BL = segment_starts(positions_BL)
    token_L = torch.arange(positions_BL.shape[1], device=positions_BL.device)
    first_BL = torch.cummax(torch.where(starts_BL, token_L, 0), dim=1).values
    return torch.cumsum(starts_BL.to(torch.int64), dim=1), positions_BL.gather(1, first_BL)


def has_continuations(positions_BL: torch.Tensor) -> bool:
    """Whether a row holds a continuation: positions that neither go on from the token before nor restart at 0."""
    return bool((segment_starts(positions_BL)[:, 1:] & (positions_BL[:, 1:] != 0)).any())


@dataclass(frozen=True)
class _Segments:
    """Each token's segment (a run of positions counting up by one) and the position its segment starts at,
    flat over the rows padded to whole blocks (padding: a segment of its own, -1)."""

    segment_T: torch.Tensor
    position_T: torch.Tensor
    start_T: torch.Tensor
    continued: bool
    """Whether some segment is a continuation (starts inside its row at a position above 0)."""

    @staticmethod
    def of(positions_BL: torch.Tensor, padded: int, continued: bool) -> _Segments:
        if not continued:  # the document rule alone: nothing to compute
            empty = positions_BL.new_empty(0)
            return _Segments(empty, empty, empty, False)
        seq_len = positions_BL.shape[1]

        def flat_padded(x_BL: torch.Tensor) -> torch.Tensor:
            return F.pad(x_BL, (0, padded - seq_len), value=-1).flatten()

        segment_BL, start_BL = segments_of(positions_BL)
        return _Segments(flat_padded(segment_BL), flat_padded(positions_BL), flat_padded(start_BL), True)

    def allowed(self, doc_T: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``(..., queries, keys)`` booleans for flat token indices ``query (..., q)`` and ``key (..., k)``: one
        document, the key no later, and of the query's segment or below the position its segment starts at."""
        q, k = query[..., :, None], key[..., None, :]
        allowed = (doc_T[q] == doc_T[k]) & (q >= k)
        if not self.continued:
            return allowed
        return allowed & ((self.segment_T[q] == self.segment_T[k]) | (self.position_T[k] < self.start_T[q]))


def document_ranges(positions_BL: torch.Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each row's documents as (start, end) token ranges; a row's leading tokens before its first position 0
    are a document of their own (a document's tail)."""
    seq_len = positions_BL.shape[1]
    ranges = []
    for starts in (positions_BL == 0).tolist():
        first = [token for token, start in enumerate(starts) if start and token]
        bounds = [0, *first, seq_len]
        ranges.append(tuple(zip(bounds[:-1], bounds[1:], strict=True)))
    return tuple(ranges)


def _per_document_attention(q_BLHD, k_BLHD, v_BLHD, blocks: DocumentBlocks, scale: float) -> torch.Tensor:
    """Each document through causal SDPA on its own tokens (``blocks.documents``), the rows put back together;
    the gradients flow through SDPA's own backward."""
    rows = []
    for row, documents in enumerate(blocks.documents):
        outs = [
            F.scaled_dot_product_attention(
                *(x[row : row + 1, start:end].transpose(1, 2) for x in (q_BLHD, k_BLHD, v_BLHD)),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            for start, end in documents
        ]
        rows.append(torch.cat(outs, dim=2))
    return torch.cat(rows).transpose(1, 2)


def _span_groups(
    doc_T: torch.Tensor,
    segments: _Segments,
    block_Q: torch.Tensor,
    low_Q: torch.Tensor,
    count_Q: torch.Tensor,
    block_size: int,
) -> tuple[SpanGroup, ...]:
    """The query blocks grouped by their number of key blocks; each one's keys run from its first token's
    document's first block to its own, in its own row (``block_Q``: each query block's flat key-block index)."""
    offset_b = torch.arange(block_size, device=doc_T.device)
    groups = []
    for count in torch.unique(count_Q).tolist():
        query_G = (count_Q == count).nonzero().flatten()
        key_GS = (low_Q[query_G] * block_size)[:, None] + torch.arange(
            count * block_size, device=doc_T.device
        )
        query_Gb = block_Q[query_G][:, None] * block_size + offset_b
        allowed_GbS = segments.allowed(doc_T, query_Gb, key_GS)
        groups.append(SpanGroup(query_G, key_GS, allowed_GbS))
    return tuple(groups)


def _padded(x_BLHD: torch.Tensor, blocks: DocumentBlocks) -> torch.Tensor:
    """``(batch, seq, heads, dim)`` -> ``(batch x padded seq, heads, dim)``, rows padded to whole blocks."""
    batch, seq_len, heads, dim = x_BLHD.shape
    pad = -seq_len % blocks.block_size
    return torch.nn.functional.pad(x_BLHD, (0, 0, 0, 0, 0, pad)).view(-1, heads, dim)


def _to_blocks(x_BLHD: torch.Tensor, blocks: DocumentBlocks, dtype: torch.dtype) -> torch.Tensor:
    """``(batch, seq, heads, dim)`` -> ``(batch x blocks, heads, block, dim)`` in ``dtype``, each row padded to
    whole blocks."""
    heads, dim = x_BLHD.shape[2:]
    x = _padded(x_BLHD.to(dtype), blocks).view(-1, blocks.block_size, heads, dim)
    return x.permute(0, 2, 1, 3).contiguous()


def _grouped(x_QHbD: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(Q, heads, block, dim)`` -> ``(Q + 1, kv heads, group x block, dim)`` with a zero discard block."""
    q, heads, b, dim = x_QHbD.shape
    x = x_QHbD.reshape(q, kv_heads, (heads // kv_heads) * b, dim)
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _from_grouped(x_QKgD: torch.Tensor, blocks: DocumentBlocks, heads: int) -> torch.Tensor:
    """The inverse of :func:`_to_blocks` + :func:`_grouped` for query-shaped tensors, back to ``(B, L, H, D)``."""
    b, n = blocks.block_size, blocks.blocks_per_row
    dim = x_QKgD.shape[-1]
    x = x_QKgD[:-1].reshape(blocks.batch * n, heads, b, dim).permute(0, 2, 1, 3)
    return x.reshape(blocks.batch, n * b, heads, dim)[:, : blocks.seq_len]


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BLHD, k_BLHD, v_BLHD, blocks: DocumentBlocks, scale: float):
        heads, kv_heads = q_BLHD.shape[2], k_BLHD.shape[2]
        dtype = torch.promote_types(q_BLHD.dtype, torch.float32)
        # The scale goes into the queries once rather than into every score.
        q = _grouped(_to_blocks(q_BLHD, blocks, dtype), kv_heads) * scale
        k = _to_blocks(k_BLHD, blocks, dtype)
        v = _to_blocks(v_BLHD, blocks, dtype)
        group = heads // kv_heads
        rows = group * blocks.block_size
        shape = (q.shape[0], kv_heads, rows)
        max_Q = torch.full(shape, -math.inf, dtype=dtype, device=q.device)
        sum_Q = torch.zeros(shape, dtype=dtype, device=q.device)
        out_Q = torch.zeros_like(q)
        for chunk in blocks.chunks:
            scores = _chunk_scores(
                q.index_select(0, chunk.query_P), k.index_select(0, chunk.key_P), chunk, group
            )
            index = chunk.query_P.view(-1, 1, 1).expand(-1, kv_heads, rows)
            max_Q.scatter_reduce_(0, index, scores.amax(-1), "amax")
            row_max = max_Q.index_select(0, chunk.query_P)
            probs = torch.exp(scores - torch.where(torch.isinf(row_max), 0.0, row_max)[..., None])
            sum_Q.index_add_(0, chunk.query_P, probs.sum(-1))
            out_Q.index_add_(0, chunk.query_P, probs @ v.index_select(0, chunk.key_P))
        live = sum_Q > 0
        out_Q = out_Q / torch.where(live, sum_Q, 1.0)[..., None]
        lse_Q = torch.where(live, torch.where(torch.isinf(max_Q), 0.0, max_Q) + torch.log(sum_Q), 0.0)
        ctx.save_for_backward(q_BLHD, k_BLHD, v_BLHD, out_Q, lse_Q)
        ctx.blocks, ctx.scale = blocks, scale
        return _from_grouped(out_Q, blocks, heads).to(q_BLHD.dtype)

    @staticmethod
    def backward(ctx, grad_BLHD):
        q_BLHD, k_BLHD, v_BLHD, out_Q, lse_Q = ctx.saved_tensors
        blocks, scale = ctx.blocks, ctx.scale
        heads, kv_heads = q_BLHD.shape[2], k_BLHD.shape[2]
        group = heads // kv_heads
        dtype = out_Q.dtype
        q = _grouped(_to_blocks(q_BLHD, blocks, dtype), kv_heads) * scale
        k = _to_blocks(k_BLHD, blocks, dtype)
        v = _to_blocks(v_BLHD, blocks, dtype)
        grad_out = _grouped(_to_blocks(grad_BLHD, blocks, dtype), kv_heads)
        delta_Q = (grad_out * out_Q).sum(-1)
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for chunk in blocks.chunks:
            q_P, k_P = q.index_select(0, chunk.query_P), k.index_select(0, chunk.key_P)
            scores = _chunk_scores(q_P, k_P, chunk, group)
            grad_out_P = grad_out.index_select(0, chunk.query_P)
            probs = torch.exp(scores - lse_Q.index_select(0, chunk.query_P)[..., None])
            grad_probs = grad_out_P @ v.index_select(0, chunk.key_P).transpose(-1, -2)
            grad_scores = probs * (grad_probs - delta_Q.index_select(0, chunk.query_P)[..., None])
            grad_q.index_add_(0, chunk.query_P, grad_scores @ k_P)
            # q is already scaled: grad_k needs the scale once, grad_q gets it below.
            grad_k.index_add_(0, chunk.key_P, grad_scores.transpose(-1, -2) @ q_P)
            grad_v.index_add_(0, chunk.key_P, probs.transpose(-1, -2) @ grad_out_P)
        grad_q = grad_q * scale
        b, n = blocks.block_size, blocks.key_blocks_per_row

        def kv_back(x):
            return x.permute(0, 2, 1, 3).reshape(blocks.batch, n * b, kv_heads, -1)[:, : blocks.keys_per_row]

        return (
            _from_grouped(grad_q, blocks, heads).to(q_BLHD.dtype),
            kv_back(grad_k).to(k_BLHD.dtype),
            kv_back(grad_v).to(v_BLHD.dtype),
            None,
            None,
        )


class _SpanAttention(torch.autograd.Function):
    """The CPU's path: each :class:`SpanGroup` through torch's fused CPU attention kernel."""

    @staticmethod
    def forward(ctx, q_BLHD, k_BLHD, v_BLHD, blocks: DocumentBlocks, scale: float):
        batch, seq_len, heads, dim = q_BLHD.shape
        b = blocks.block_size
        q_QbHD = _padded(q_BLHD, blocks).view(-1, b, heads, dim)
        k_THD, v_THD = _padded(k_BLHD, blocks), _padded(v_BLHD, blocks)
        out_QHbD = q_BLHD.new_empty(q_QbHD.shape[0], heads, b, dim)
        lse_QHb = q_BLHD.new_empty(
            q_QbHD.shape[0], heads, b, dtype=torch.promote_types(q_BLHD.dtype, torch.float32)
        )
        for group in blocks.spans:
            out_G, lse_G = cpu_flash_attention(
                *_span_inputs(group, q_QbHD, k_THD, v_THD), mask_B1LS=group.mask(q_BLHD.dtype), scale=scale
            )
            out_QHbD.index_copy_(0, group.query_G, out_G)
            lse_QHb.index_copy_(0, group.query_G, lse_G)
        ctx.save_for_backward(q_BLHD, k_BLHD, v_BLHD, out_QHbD, lse_QHb)
        ctx.blocks, ctx.scale = blocks, scale
        return out_QHbD.permute(0, 2, 1, 3).reshape(batch, -1, heads, dim)[:, :seq_len]

    @staticmethod
    def backward(ctx, grad_BLHD):
        q_BLHD, k_BLHD, v_BLHD, out_QHbD, lse_QHb = ctx.saved_tensors
        blocks, scale = ctx.blocks, ctx.scale
        batch, seq_len, heads, dim = q_BLHD.shape
        b = blocks.block_size
        q_QbHD = _padded(q_BLHD, blocks).view(-1, b, heads, dim)
        grad_QbHD = _padded(grad_BLHD.to(q_BLHD.dtype), blocks).view(-1, b, heads, dim)
        k_THD, v_THD = _padded(k_BLHD, blocks), _padded(v_BLHD, blocks)
        grad_q_QHbD = torch.empty_like(out_QHbD)
        grad_k_THD, grad_v_THD = torch.zeros_like(k_THD), torch.zeros_like(v_THD)
        for group in blocks.spans:
            q_G, k_G, v_G = _span_inputs(group, q_QbHD, k_THD, v_THD)
            grad_q, grad_k, grad_v = cpu_flash_attention_backward(
                grad_QbHD.index_select(0, group.query_G).transpose(1, 2),
                q_G,
                k_G,
                v_G,
                out_QHbD.index_select(0, group.query_G),
                lse_QHb.index_select(0, group.query_G),
                mask_B1LS=group.mask(q_BLHD.dtype),
                scale=scale,
            )
            grad_q_QHbD.index_copy_(0, group.query_G, grad_q)
            keys = group.key_GS.flatten()
            grad_k_THD.index_add_(0, keys, grad_k.transpose(1, 2).reshape(-1, *k_THD.shape[1:]))
            grad_v_THD.index_add_(0, keys, grad_v.transpose(1, 2).reshape(-1, *v_THD.shape[1:]))

        def unpadded(x_THD):
            return x_THD.view(batch, -1, *x_THD.shape[1:])[:, : blocks.keys_per_row]

        grad_q_BLHD = grad_q_QHbD.permute(0, 2, 1, 3).reshape(batch, -1, heads, dim)[:, :seq_len]
        return grad_q_BLHD, unpadded(grad_k_THD), unpadded(grad_v_THD), None, None


def _span_inputs(group: SpanGroup, q_QbHD, k_THD, v_THD):
    """A group's queries ``(G, heads, block, dim)``, its gathered keys and values ``(G, kv heads, span, dim)``."""
    span = group.key_GS.shape[1]
    keys = group.key_GS.flatten()

    def gathered(x_THD):
        return x_THD.index_select(0, keys).view(-1, span, *x_THD.shape[1:]).transpose(1, 2)

    return q_QbHD.index_select(0, group.query_G).transpose(1, 2), gathered(k_THD), gathered(v_THD)


def _chunk_scores(q_P: torch.Tensor, k_P: torch.Tensor, chunk: BlockChunk, group: int) -> torch.Tensor:
    """``(pairs, kv heads, group x block, block)`` scores of the (scaled) queries, -inf where the pair may not
    attend."""
    scores = q_P @ k_P.transpose(-1, -2)
    pairs, kv_heads, rows, b = scores.shape
    allowed = chunk.allowed_PQK[:, None, None]
    return (
        scores.view(pairs, kv_heads, group, b, b)
        .masked_fill(~allowed, -math.inf)
        .view(pairs, kv_heads, rows, b)
    )


def block_sparse_attention(
    q_BLHD: torch.Tensor,
    k_BLHD: torch.Tensor,
    v_BLHD: torch.Tensor,
    blocks: DocumentBlocks,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-document causal attention of ``(batch, seq, heads, head_dim)`` queries over ``(batch, seq, kv heads,
    head_dim)`` keys and values (grouped-query when there are fewer kv heads), computing only ``blocks``."""
    batch, seq_len, heads, dim = q_BLHD.shape
    if (batch, seq_len, k_BLHD.shape[1]) != (blocks.batch, blocks.seq_len, blocks.keys_per_row):
        raise ValueError(
            f"document blocks for {blocks.batch} x {blocks.seq_len} queries over {blocks.keys_per_row} keys, "
            f"got {batch} x {seq_len} over {k_BLHD.shape[1]}"
        )
    if heads % k_BLHD.shape[2]:
        raise ValueError(f"{heads} query heads do not group over {k_BLHD.shape[2]} kv heads")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if blocks.documents is not None:
        # Built for the CPU, with no block pairs: SDPA per document, as causal SDPA computes on a whole row,
        # autocast included.
        return _per_document_attention(q_BLHD, k_BLHD, v_BLHD, blocks, scale)
    if q_BLHD.device.type == "cpu" and blocks.spans:
        # One dtype for the fused kernel: autocast's where the rank computes under it (a whole-model CPU rank,
        # models.fsdp_comms), as causal SDPA would; else the inputs' common one.
        dtype = (
            torch.get_autocast_dtype("cpu")
            if torch.is_autocast_enabled("cpu")
            else torch.promote_types(torch.promote_types(q_BLHD.dtype, k_BLHD.dtype), v_BLHD.dtype)
        )
        with torch.autocast("cpu", enabled=False):
            return _SpanAttention.apply(q_BLHD.to(dtype), k_BLHD.to(dtype), v_BLHD.to(dtype), blocks, scale)
    if q_BLHD.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # The plain-op path chooses its own precision (fp32 for bf16 inputs) and accumulates in buffers of it,
        # which autocast's bf16 products would not match.
        with torch.autocast("cpu", enabled=False):
            return _BlockSparseAttention.apply(q_BLHD, k_BLHD, v_BLHD, blocks, scale)
    return _BlockSparseAttention.apply(q_BLHD, k_BLHD, v_BLHD, blocks, scale)
