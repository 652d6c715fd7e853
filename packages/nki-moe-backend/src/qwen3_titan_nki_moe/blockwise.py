"""The block layout the NKI ``grouped_swiglu`` kernels run on, in plain PyTorch (testable anywhere).

NKI kernels need static shapes, but the experts' token groups have data-dependent sizes. So
each expert's group is padded up to whole blocks of ``BLOCK`` (128) rows, and the slot tensor
has a static number of blocks ``N = ceil(R / BLOCK) + E`` (the worst case: every expert's
last block partly empty)::

    offsets_E = [3, 3, 8] (R=8, E=3), BLOCK=4  ->  blocks per expert [1, 0, 2], N = 2 + 3 = 5
    block_expert_N = [0, 2, 2, 2, 2]            (unused trailing blocks: the last expert, zero rows)
    block_start_E1 = [0, 1, 1, 5]               (expert e owns blocks start[e] .. start[e+1]-1)
    row_of_slot    = [0 1 2 8 | 3 4 5 6 | 7 8 8 8 | 8 8 8 8 | 8 8 8 8]   (8 = the zero row)
    slot_of_row_R  = [0 1 2 4 5 6 7 8]

The NKI kernels loop over the experts at run time and, inside, over the expert's blocks
``block_start_E1[e] .. block_start_E1[e+1]-1`` (``nl.fori_loop`` bounds read from this table),
so an expert's weights are read once per call however many blocks it has. The last expert's
range runs to ``N``: the trailing blocks are all padding, and computing them writes their
(zero) outputs instead of leaving them unwritten.

Padding rows are zeros, so they contribute nothing to the outputs or weight gradients.
:func:`blockwise_swiglu` computes the op through this layout with torch ops: the oracle that
ties the layout to ``qwen3_titan::grouped_swiglu`` on CPU. :func:`block_columns` and
:func:`block_rows` are the two HBM views of the slot rows the kernels read (block by block,
transposed or not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 128


@dataclass(frozen=True)
class BlockLayout:
    num_blocks: int
    block: int
    block_expert_N: Tensor  # int32 [N]: the expert of each block
    block_start_E1: Tensor  # int32 [E + 1, 1]: expert e's blocks are start[e] .. start[e+1]-1; start[E] = N
    row_of_slot: Tensor  # int64 [N * block]: the x row feeding each padded slot (R = zero row)
    slot_of_row_R: Tensor  # int64 [R]: the padded slot of each x row
    padded_offsets_E: Tensor  # int32 [E]: cumulative padded rows per expert (grouped GEMMs on the layout)


def num_blocks(rows: int, num_experts: int, block: int = BLOCK) -> int:
    return -(-rows // block) + num_experts


def block_layout(offsets_E: Tensor, rows: int, block: int = BLOCK) -> BlockLayout:
    """The padded layout of ``rows`` expert-sorted rows; computed on the host (E values)."""
    offsets = offsets_E.detach().to("cpu", torch.int64)
    num_experts = offsets.shape[0]
    counts_E = torch.diff(offsets, prepend=offsets.new_zeros(1))
    blocks_E = -(-counts_E // block)
    block_end_E = torch.cumsum(blocks_E, 0)
    block_start_E = block_end_E - blocks_E
    n = num_blocks(rows, num_experts, block)
    block_expert_N = torch.searchsorted(block_end_E, torch.arange(n), right=True).clamp(max=num_experts - 1)

    row = torch.arange(rows)
    expert_R = torch.searchsorted(offsets, row, right=True).clamp(max=num_experts - 1)
    group_start_R = (offsets - counts_E)[expert_R]
    slot_of_row_R = block_start_E[expert_R] * block + (row - group_start_R)
    # Rows past offsets_E[-1] belong to no expert: they read the last slot, always padding
    # (at most N - 1 blocks are ever used), whose output is zero.
    grouped = row < offsets[-1]
    slot_of_row_R = torch.where(grouped, slot_of_row_R, n * block - 1)
    row_of_slot = torch.full((n * block,), rows, dtype=torch.int64)
    row_of_slot[slot_of_row_R[grouped]] = row[grouped]
    device = offsets_E.device
    return BlockLayout(
        num_blocks=n,
        block=block,
        block_expert_N=block_expert_N.to(device, torch.int32),
        block_start_E1=torch.cat([block_start_E, torch.tensor([n])]).view(-1, 1).to(device, torch.int32),
        row_of_slot=row_of_slot.to(device),
        slot_of_row_R=slot_of_row_R.to(device),
        padded_offsets_E=(block_end_E * block).to(device, torch.int32),
    )


def to_blocks(x_RD: Tensor, layout: BlockLayout) -> Tensor:
    """``[N * block, D]``: x's rows in their padded slots, zeros elsewhere (differentiable)."""
    padded = torch.cat([x_RD, x_RD.new_zeros(1, x_RD.shape[1])])
    return padded.index_select(0, layout.row_of_slot)


def from_blocks(y_SD: Tensor, layout: BlockLayout) -> Tensor:
    """``[R, D]``: each row's slot back (differentiable)."""
    return y_SD.index_select(0, layout.slot_of_row_R)


def block_rows(x_SD: Tensor, block: int = BLOCK) -> Tensor:
    """``[N, block, D]``: the slot rows as blocks (a view; the kernels' row-major block reads)."""
    return x_SD.view(-1, block, x_SD.shape[1])


def block_columns(x_SD: Tensor, block: int = BLOCK) -> Tensor:
    """``[N, D, block]``: each block transposed, blocks contiguous one after another.

    The kernels contract over D on the 128 partitions, so they read a block as ``[d, t]`` tiles;
    with the blocks stored one after another, block ``n`` starts at element ``n * D * block``:
    a run-time block index is a ``scalar_offset`` on dimension 0 and nothing else.
    """
    return block_rows(x_SD, block).transpose(1, 2).contiguous()


def blockwise_swiglu(
    x_RD: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, w2_EDF: Tensor, offsets_E: Tensor
) -> Tensor:
    """``grouped_swiglu`` computed block by block through :func:`block_layout` (torch ops)."""
    layout = block_layout(offsets_E, x_RD.shape[0])
    x_NBD = to_blocks(x_RD, layout).view(layout.num_blocks, layout.block, -1)
    expert_N = layout.block_expert_N.long()
    gate = torch.bmm(x_NBD, w1_EFD[expert_N].transpose(1, 2))
    up = torch.bmm(x_NBD, w3_EFD[expert_N].transpose(1, 2))
    y_NBD = torch.bmm(F.silu(gate) * up, w2_EDF[expert_N].transpose(1, 2))
    return from_blocks(y_NBD.reshape(-1, x_RD.shape[1]), layout)
