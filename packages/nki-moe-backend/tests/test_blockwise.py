"""The block layout the grouped SwiGLU kernels loop over: expert ranges, and the two HBM views of a block."""

import pytest
import torch
from qwen3_titan_nki_moe import blockwise


def _layout(counts, block=blockwise.BLOCK):
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    return blockwise.block_layout(offsets, int(offsets[-1]), block=block), offsets


def test_expert_block_ranges_of_the_docstring_example():
    layout, _ = _layout([3, 0, 5], block=4)
    assert layout.block_start_E1.tolist() == [[0], [1], [1], [5]]
    assert layout.block_start_E1.dtype == torch.int32


@pytest.mark.parametrize(
    "counts", [[130, 0, 1, 250, 0], [0, 0, 7], [128, 128], [1], [0, 300, 0, 0, 129]], ids=str
)
def test_each_expert_loops_over_exactly_its_blocks(counts):
    layout, offsets = _layout(counts)
    start = layout.block_start_E1.view(-1).tolist()
    experts, blocks = len(counts), layout.num_blocks
    # The ranges tile 0 .. N: the kernels' nested loops visit every block once, so every slot is written.
    assert start[0] == 0 and start[-1] == blocks and start == sorted(start)
    for e in range(experts):
        owned = list(range(start[e], start[e + 1]))
        assert all(layout.block_expert_N[n] == e for n in owned)
        rows = range(int(offsets[e]) - counts[e], int(offsets[e]))
        slots_blocks = {int(layout.slot_of_row_R[r]) // blockwise.BLOCK for r in rows}
        assert slots_blocks <= set(owned)  # every row of e sits in one of e's blocks
        if e < experts - 1:  # the last expert also takes the trailing padding blocks
            assert len(owned) == -(-counts[e] // blockwise.BLOCK)


def test_block_views_are_what_the_kernels_address():
    dim, block, blocks = 256, blockwise.BLOCK, 3
    x_SD = torch.randn(blocks * block, dim)
    columns = blockwise.block_columns(x_SD)
    assert columns.shape == (blocks, dim, block) and columns.is_contiguous()
    flat = columns.reshape(-1)
    for n, d, t in [(0, 0, 0), (1, 130, 5), (2, dim - 1, block - 1)]:
        # Block n starts at element n * D * 128: the kernels' scalar_offset n on dimension 0.
        assert flat[n * dim * block + d * block + t] == x_SD[n * block + t, d]
    rows = blockwise.block_rows(x_SD)
    assert rows.shape == (blocks, block, dim) and rows.data_ptr() == x_SD.data_ptr()
    assert torch.equal(rows[2, 5], x_SD[2 * block + 5])
