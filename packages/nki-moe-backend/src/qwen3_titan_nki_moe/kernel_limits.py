"""The NKI kernels' on-chip memory arithmetic, and the size limits that follow from it.

The hardware (NKI "Trainium2 Architecture Guide", ``nki/guides/architecture/trainium2_arch.rst``):
a trn2 NeuronCore-v3 has 28 MiB of SBUF, "128 partitions of 224KiB" (up from trn1's
NeuronCore-v2: 24 MiB, 128 x 192 KiB), and 2 MiB of PSUM, 16 KiB per partition in 8 banks of
2 KiB (one ``[128, 512]`` fp32 matmul output). A matmul takes a stationary operand of at most
128 x 128 and a moving operand of at most 512 columns (``nl.tile_size.gemm_*_fmax``).

Not all of a partition is the kernel's: the NKI library's own kernels budget
``224 * 1024 - 16384`` bytes per partition (nki-library ``core/mlp/mlp_cte/mlp_cte_constants.py``,
``experimental/moe/bwd/bwmm_bwd_dropless.py``: ``MAX_AVAILABLE_SBUF_SIZE``). We use the same
208 KiB (:data:`SBUF_BUDGET`).

Each ``*_bytes`` function is the sum, per partition, of the SBUF tiles its kernel allocates,
each counted once (single-buffered: a tile allocated inside a loop is one buffer reused by
every iteration). The compiler may add buffers for pipelining; the budget's margin is for
that. The CPU twin of NKI in the tests records every allocation the kernels make and checks
these sums against them, so a kernel change that grows its footprint fails there first.

Nothing here imports the Neuron SDK: the launcher's shape rules (``constraints``) use it on
any machine.
"""

from __future__ import annotations

KiB = 1024
PARTITIONS = 128
MOVING_MAX = 512  # columns of a matmul's moving operand: one PSUM bank of fp32
SBUF_PARTITION_BYTES = 224 * KiB  # trn2, NeuronCore-v3
SBUF_RESERVED_BYTES = 16 * KiB  # kept free, as the NKI library's kernels do
SBUF_BUDGET = SBUF_PARTITION_BYTES - SBUF_RESERVED_BYTES
PSUM_PARTITION_BYTES = 16 * KiB
PSUM_BANK_BYTES = 2 * KiB
FP32 = 4
INT32 = 4
# Run-time offsets are int32 NkiScalars; an int64 one reaches past 4 GB but cannot bound a
# loop. Every HBM tensor a kernel addresses stays under 2 GiB, so no offset can overflow.
MAX_HBM_TENSOR_BYTES = 2**31
# rope_hf moves this many bytes per partition per transfer at most (x 128 partitions = 1 MiB).
ROPE_RUN_BYTES = 8 * KiB


def fits_budget(nbytes: int) -> bool:
    return nbytes <= SBUF_BUDGET


# rms_norm ---------------------------------------------------------------------------------


def rms_norm_forward_bytes(dim: int, itemsize: int, weight_itemsize: int) -> int:
    """x, its fp32 square, y (x's dtype), the weight row (its dtype); sum, mean and rstd columns."""
    return dim * (FP32 + 2 * itemsize + weight_itemsize) + 3 * FP32


def rms_norm_backward_bytes(dim: int, itemsize: int, weight_itemsize: int) -> int:
    """x, g; two fp32 scratch rows; the weight row; the fp32 ``[1, D]`` dw accumulator (its
    address range is reserved on every partition); ones, sum, mean, rstd, dot, coef columns."""
    return dim * (3 * FP32 + 2 * itemsize + weight_itemsize) + 6 * FP32


MAX_NORM_DIM = 8192
"""Largest hidden size rms_norm takes: fp32 backward 24 B x 8192 + 24 = 192 KiB of the 208 KiB."""


def rms_norm_fits(dim: int, itemsize: int, weight_itemsize: int) -> bool:
    return dim <= MAX_NORM_DIM and fits_budget(rms_norm_backward_bytes(dim, itemsize, weight_itemsize))


# rope_hf ----------------------------------------------------------------------------------


def rope_hf_bytes(head_dim: int, rows_per_partition: int, itemsize: int) -> int:
    """cos, sin, x and out ``[128, R, H]``; the two half-width products ``[128, R, H/2]``."""
    return 5 * rows_per_partition * head_dim * itemsize


def rope_rows_per_partition(tiles_per_program: int, head_dim: int, itemsize: int) -> int:
    """Positions per partition per transfer: the largest divisor of the program's share of
    128-position tiles whose run, ``R * H * itemsize`` bytes, stays within :data:`ROPE_RUN_BYTES`."""
    best = 1
    for rows in range(1, tiles_per_program + 1):
        if tiles_per_program % rows == 0 and rows * head_dim * itemsize <= ROPE_RUN_BYTES:
            best = rows
    return best


MAX_ROPE_HEAD_DIM = 8192
"""Largest head_dim rope_hf takes: one position per partition in fp32, 5 x 8192 x 4 = 160 KiB."""


def rope_hf_fits(head_dim: int, itemsize: int) -> bool:
    return (
        head_dim % 2 == 0
        and head_dim <= MAX_ROPE_HEAD_DIM
        and fits_budget(rope_hf_bytes(head_dim, 1, itemsize))
    )


# grouped_swiglu ---------------------------------------------------------------------------
# dim = D (hidden_size), hidden = Fp (moe_intermediate_size / LNC: one program's share).


def grouped_swiglu_forward_bytes(dim: int, hidden: int, itemsize: int) -> int:
    """Resident per expert: w1^T, w3^T ``[d, Dt, Fp]`` and w2^T ``[f, Ft, D]`` (3*Fp*D/128 elements);
    staging rows for their transposes (two D wide, one Fp wide); per block: x^T (D), gate, up,
    h, h^T (4*Fp); the fp32 output row (4*D bytes); the two int32 block bounds."""
    resident = 3 * hidden * dim // PARTITIONS
    return itemsize * (resident + 3 * dim + 5 * hidden) + FP32 * dim + 2 * INT32


def grouped_swiglu_backward_bytes(dim: int, hidden: int, itemsize: int) -> int:
    """Resident per expert: w1, w3 ``[f, Ft, D]``, w2 ``[d, Dt, Fp]`` as stored, and w1^T, w3^T
    (5*Fp*D/128 elements); per block: x^T, dy^T (2*D); gate, up, dh, silu, h, dup, dgate,
    dgate^T, dup^T (9*Fp); the fp32 silu slope (4*Fp bytes) and dx row (4*D bytes); the bounds."""
    resident = 5 * hidden * dim // PARTITIONS
    return itemsize * (resident + 2 * dim + 9 * hidden) + FP32 * (hidden + dim) + 2 * INT32


def grouped_swiglu_wgrad_bytes(dim: int, hidden: int, itemsize: int) -> int:
    """fp32 accumulators (dw1, dw3 chunks ``[f, <=512]``, dw2 chunk ``[d, <=512]``); per block the
    x chunk, one gradient tile, dy tile and h chunk; the three rounded output chunks; the bounds."""
    wd, wf = min(MOVING_MAX, dim), min(MOVING_MAX, hidden)
    accumulators = FP32 * (2 * wd + wf)
    inputs = itemsize * (wd + PARTITIONS + PARTITIONS + wf)
    outputs = itemsize * (2 * wd + wf)
    return accumulators + inputs + outputs + 2 * INT32


def grouped_swiglu_bytes(dim: int, hidden: int, itemsize: int) -> int:
    """The largest of the three kernels' footprints (the backward's, at every realistic shape)."""
    return max(
        grouped_swiglu_forward_bytes(dim, hidden, itemsize),
        grouped_swiglu_backward_bytes(dim, hidden, itemsize),
        grouped_swiglu_wgrad_bytes(dim, hidden, itemsize),
    )


def grouped_swiglu_fits(dim: int, hidden: int, itemsize: int) -> bool:
    return (
        dim % PARTITIONS == 0
        and hidden % PARTITIONS == 0
        and fits_budget(grouped_swiglu_bytes(dim, hidden, itemsize))
    )


def max_grouped_swiglu_hidden(dim: int, itemsize: int) -> int:
    """The largest per-core intermediate size (a multiple of 128) whose footprint fits; 0 if none."""
    hidden = 0
    while grouped_swiglu_fits(dim, hidden + PARTITIONS, itemsize):
        hidden += PARTITIONS
    return hidden


def grouped_swiglu_hbm_bytes(
    rows: int, experts: int, dim: int, hidden_all: int, lnc: int, itemsize: int
) -> int:
    """The largest HBM tensor one call addresses: the fp32 ``[LNC, N, 128, D]`` partial sums or a
    weight ``[E, F, D]``, N = ceil(rows / 128) + E blocks."""
    blocks = -(-rows // PARTITIONS) + experts
    return max(lnc * blocks * PARTITIONS * dim * FP32, experts * hidden_all * dim * itemsize)
