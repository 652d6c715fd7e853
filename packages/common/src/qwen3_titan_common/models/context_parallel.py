"""Context parallelism for per-document attention: a row's tokens split over the CP ranks, keys and values gathered.

torchtitan 0.3.0 runs context parallelism with Flex attention only (it shards Flex's block mask), and Flex has no
CPU backward while Neuron runs neither Flex nor varlen; packed documents under its CP are an open request
upstream. This is Llama 3's recipe instead, on our block-sparse per-document attention
(``models.document_blocks``), so it runs on any device and any collective backend:

- each row is cut into ``2 x degree`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 x degree - 1 - r``
  (zig-zag): under a causal mask the early chunks attend to few keys and the late ones to many, and the pairing
  gives every rank about the same work; with packed documents each rank's share of the block pairs follows
  the documents, and no rule is put on their lengths (a document may cross any chunk edge);
- every rank keeps the whole row's positions (the data loader gives the CP ranks the same rows), so it builds
  the block pairs of its own queries against the whole row (``document_blocks(query_blocks=...)``) with no
  communication, and positions restart per document exactly as on one rank;
- in each attention layer the keys and values of the CP group are gathered (one all-gather of fixed shape, whose
  backward sums their gradients back to the ranks that hold them) and put back in row order; each rank then
  computes only its queries' same-document key blocks.

The loss needs nothing more: torchtitan counts the global batch's trained tokens before this split (every CP
rank sees the same full rows) and sums each rank's share of the loss over its ``loss`` mesh (batch x cp);
FSDP shards over ``fsdp`` (data x cp) and sums the gradients there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qwen3_titan_common.models.document_blocks import DocumentBlocks, block_sparse_attention, document_blocks


@dataclass(frozen=True)
class ContextParallelBlocks:
    """A CP rank's attention masks: its queries' block pairs against the whole row, and the group to gather
    the row's keys and values from."""

    blocks: DocumentBlocks
    group: dist.ProcessGroup


def chunk_size(seq_len: int, degree: int) -> int:
    """Tokens in each of a row's ``2 x degree`` chunks."""
    if seq_len % (2 * degree):
        raise ValueError(f"a row of {seq_len} tokens does not split into 2 x {degree} equal chunks")
    return seq_len // (2 * degree)


def block_size_for(seq_len: int, degree: int, block_size: int) -> int:
    """The attention's block size under CP: the configured one where it divides a chunk, else the largest
    divisor of both (a block never straddles two ranks' chunks)."""
    return math.gcd(block_size, chunk_size(seq_len, degree))


def local_token_index(seq_len: int, degree: int, rank: int, device=None) -> torch.Tensor:
    """The row's token indices CP rank ``rank`` holds, in the order it holds them: chunk ``rank``, then chunk
    ``2 x degree - 1 - rank``."""
    chunk = chunk_size(seq_len, degree)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * degree - 1 - rank) * chunk, (2 * degree - rank) * chunk, device=device)
    return torch.cat([first, last])


class _GatherRanks(torch.autograd.Function):
    """Every rank's tensor stacked ``(ranks, ...)``, in one fixed-shape all-gather; the backward sums each
    rank's part of the gradient over the ranks (a reduce-scatter; gloo has none, so an all-to-all and a sum in
    rank order there).

    Hand-written because torch 2.14 deprecates its public autograd all-gather
    (``torch.distributed.nn.functional.all_gather``, which warns at every call site) in favour of a private one;
    the collectives are torch's public ``all_gather_single``, ``reduce_scatter_single`` and ``all_to_all_single``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ranks = dist.get_world_size(group)
        out = x.new_empty((ranks * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(ranks, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.GLOO:
            received = torch.empty_like(grad)
            dist.all_to_all_single(received, grad, group=ctx.group)
            return received.sum(0), None
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(out, grad.flatten(0, 1), group=ctx.group)
        return out, None


def gather_row(x_BLHD: torch.Tensor, cp: ContextParallelBlocks) -> torch.Tensor:
    """The whole row of every CP rank's ``(batch, local seq, heads, dim)`` keys or values, in row order; its
    gradient is summed back to the rank that holds each token."""
    parts = _GatherRanks.apply(x_BLHD, cp.group).unbind(0)
    half = x_BLHD.shape[1] // 2
    # Rank r holds chunks r and 2 x degree - 1 - r: the row is every rank's first half in rank order, then
    # every rank's second half in reverse rank order.
    return torch.cat([p[:, :half] for p in parts] + [p[:, half:] for p in reversed(parts)], dim=1)


def row_attention(
    q_BLHD: torch.Tensor,
    k_BLHD: torch.Tensor,
    v_BLHD: torch.Tensor,
    cp: ContextParallelBlocks,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """A CP rank's per-document attention: its ``(batch, local seq, heads, dim)`` queries against the whole
    row's keys and values, gathered from its group; every attention of ours under CP (torchtitan's inner
    attention, hf-v5's transformers attention function) calls this one."""
    return block_sparse_attention(
        q_BLHD, gather_row(k_BLHD, cp), gather_row(v_BLHD, cp), cp.blocks, scale=scale
    )


def context_parallel_blocks(
    positions_BL: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    degree: int,
    rank: int,
    block_size: int,
    pairs_per_chunk: int,
    fixed_shapes: bool,
) -> ContextParallelBlocks:
    """The block pairs of CP rank ``rank``'s queries against the whole row, from the whole row's positions."""
    seq_len = positions_BL.shape[1]
    block = block_size_for(seq_len, degree, block_size)
    chunk_blocks = chunk_size(seq_len, degree) // block
    local = local_token_index(seq_len, degree, rank, device=positions_BL.device)
    query_blocks = local[::block] // block
    assert query_blocks.numel() == 2 * chunk_blocks
    blocks = document_blocks(
        positions_BL,
        block_size=block,
        pairs_per_chunk=pairs_per_chunk,
        fixed_shapes=fixed_shapes,
        query_blocks=query_blocks,
    )
    assert blocks is not None
    return ContextParallelBlocks(blocks=blocks, group=group)


def split_for_context_parallel(
    input_dict: dict[str, torch.Tensor],
    labels: torch.Tensor,
    *,
    attention,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A batch of whole rows as this CP rank trains it: its share of the tokens, labels and positions, and its
    :class:`ContextParallelBlocks` as the model's attention masks. ``attention``: the model's
    ``DocumentBlockAttention.Config`` (block size, chunking, fixed shapes)."""
    inputs = input_dict["input"]
    extra = {key: value for key, value in input_dict.items() if key != "input"}
    batch, seq_len = inputs.shape
    positions = extra.get("positions")
    if positions is None:
        # Rows without positions are one document each, numbered from 0.
        positions = torch.arange(seq_len, device=inputs.device).expand(batch, seq_len)
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    index = local_token_index(seq_len, degree, rank, device=inputs.device)
    extra["attention_masks"] = context_parallel_blocks(
        positions,
        group=group,
        degree=degree,
        rank=rank,
        block_size=attention.block_size,
        pairs_per_chunk=attention.pairs_per_chunk,
        fixed_shapes=attention.fixed_shapes,
    )
    extra["positions"] = positions[:, index]
    return inputs[:, index], labels[:, index], extra


def parallelize_decoder(
    model,
    *,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str,
    skip_dp: bool = False,
):
    """torchtitan's Qwen3 parallelisation on its ``partial_dtensor`` path, without its CP wrapping of the inner
    attention (``apply_cp_to_forward`` would turn SDPA's inputs into CP-sharded DTensors for a ring attention
    that knows no documents): tensor and expert parallelism as the model plans them, activation checkpointing,
    compile, then FSDP2 over the data x CP ranks (``fsdp`` mesh), as ``parallelize_qwen3`` does."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    if skip_dp:
        return model
    replicated = parallel_dims.dp_replicate_enabled
    dp_mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if replicated else ["fsdp"])
    edp_mesh = None
    if parallel_dims.ep_enabled:
        edp_mesh = parallel_dims.get_optional_mesh(["dp_replicate", "efsdp"] if replicated else ["efsdp"])
    apply_fsdp_to_decoder(
        model,
        dp_mesh,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=parallel_dims.pp_enabled,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        ep_degree=parallel_dims.ep,
        edp_mesh=edp_mesh,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    return model
