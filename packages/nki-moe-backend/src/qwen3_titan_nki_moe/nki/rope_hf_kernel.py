"""NKI kernel of ``rope_hf``: rotary embedding in HF layout, forward and backward in one kernel.

Contract (same as ``qwen3_titan::rope_hf``): ``x`` is ``[B, N, S, H]``, ``cos``/``sin`` are
``[Bc, S, H]`` with ``Bc`` 1 or B. With halves ``x1 | x2``::

    forward:   out1 = x1*cos1 - x2*sin1        out2 = x2*cos2 + x1*sin2
    backward:  dx1  = g1*cos1 + g2*sin2        dx2  = g2*cos2 - g1*sin1

(the backward is ``g*cos + rotate_half^T(g*sin)``). Every product and sum is rounded to the
input dtype, the order transformers' ``apply_rotary_pos_emb`` uses.

Layout: ``head_dim`` is on the free axis, positions on the partitions, so any even head_dim
works. One transfer moves ``R`` consecutive positions per partition: partition ``p`` holds
positions ``s0 + p*R .. s0 + p*R + R - 1``, a contiguous run of ``R*H`` elements of one head in
HBM (the earlier version moved one 128-position tile per DMA, a ``H``-element row per partition:
256 bytes at H 128 in bf16). ``R`` (``rows_per_partition``) is chosen on the host
(``kernel_limits.rope_rows_per_partition``): the largest divisor of the program's share of
128-position tiles with ``R*H*b <= 8 KiB``, so a transfer moves up to 1 MiB. cos/sin tiles are
read once per chunk and reused by every head (and every batch when ``Bc`` is 1).

The grid is ``(LNC,)``: program ``p`` takes the sequence positions ``p*S/LNC ..`` (hence "seq_len a
multiple of 128 x LNC").

Limits (``qwen3_titan_nki_moe.kernel_limits``, b bytes per element):

- SBUF ``5*R*H*b`` bytes per partition (cos, sin, x, out, and two half-width products), at most
  40 KiB with the 8 KiB run (20 KiB at 30B-A3B in bf16: R 16, H 128); ``R = 1`` needs
  ``5*H*b``: head_dim <= ``MAX_ROPE_HEAD_DIM`` = 8192 (160 KiB in fp32, inside the 208 KiB budget);
- the loops are static (unrolled): ``8`` instructions per head per chunk, plus 2 per chunk (per
  batch row when ``Bc`` is B) for cos/sin; ``S / (128*LNC*R)`` chunks per program. Qwen3-30B-A3B
  at seq 4096, LNC 2, bf16 (R 16, one chunk): 258 instructions for q's 32 heads, 34 for k's 4;
- rows (batch x heads x seq) per call: no limit but the instruction count above; offsets are
  static Python ints, and SBUF holds one chunk of one head at a time.

UNTESTED ON HARDWARE (see the package docstring).
"""

from __future__ import annotations

from qwen3_titan_nki_moe.nki._lang import P, nisa, nki, nl


def _runs(src, row0: int, rows: int, head_dim: int):
    """The ``[128, rows, H]`` access: partition ``p`` reads rows ``row0 + p*rows ..`` of ``src``'s
    flattened ``[.., H]`` rows, ``rows*H`` contiguous elements."""
    run = rows * head_dim
    return src.ap(pattern=[[run, P], [head_dim, rows], [1, head_dim]], offset=row0 * head_dim)


@nki.jit
def rope_hf_kernel(x, cos, sin, backward: bool, rows_per_partition: int):
    batch, heads, seq, head_dim = x.shape
    half = head_dim // 2
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    share = seq // lnc
    rows = rows_per_partition
    chunk = P * rows
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)

    # Forward multiplies the second half by sin1 and subtracts; backward swaps the sin halves and signs.
    first_sin = slice(half, head_dim) if backward else slice(0, half)
    second_sin = slice(0, half) if backward else slice(half, head_dim)
    first_op = nl.add if backward else nl.subtract
    second_op = nl.subtract if backward else nl.add

    for c in range(share // chunk):
        s0 = pid * share + c * chunk
        for b in range(batch):
            if b == 0 or cos.shape[0] > 1:
                cb = b if cos.shape[0] > 1 else 0
                cos_t = nl.ndarray((P, rows, head_dim), dtype=x.dtype, buffer=nl.sbuf)
                sin_t = nl.ndarray((P, rows, head_dim), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=cos_t, src=_runs(cos, cb * seq + s0, rows, head_dim))
                nisa.dma_copy(dst=sin_t, src=_runs(sin, cb * seq + s0, rows, head_dim))
            for n in range(heads):
                row0 = (b * heads + n) * seq + s0
                x_t = nl.ndarray((P, rows, head_dim), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=x_t, src=_runs(x, row0, rows, head_dim))
                a_t = nl.ndarray((P, rows, half), dtype=x.dtype, buffer=nl.sbuf)
                r_t = nl.ndarray((P, rows, half), dtype=x.dtype, buffer=nl.sbuf)
                out_t = nl.ndarray((P, rows, head_dim), dtype=x.dtype, buffer=nl.sbuf)

                nisa.tensor_tensor(
                    dst=a_t, data1=x_t[:, :, 0:half], data2=cos_t[:, :, 0:half], op=nl.multiply
                )
                nisa.tensor_tensor(
                    dst=r_t, data1=x_t[:, :, half:head_dim], data2=sin_t[:, :, first_sin], op=nl.multiply
                )
                nisa.tensor_tensor(dst=out_t[:, :, 0:half], data1=a_t, data2=r_t, op=first_op)

                nisa.tensor_tensor(
                    dst=a_t, data1=x_t[:, :, half:head_dim], data2=cos_t[:, :, half:head_dim], op=nl.multiply
                )
                nisa.tensor_tensor(
                    dst=r_t, data1=x_t[:, :, 0:half], data2=sin_t[:, :, second_sin], op=nl.multiply
                )
                nisa.tensor_tensor(dst=out_t[:, :, half:head_dim], data1=a_t, data2=r_t, op=second_op)

                nisa.dma_copy(dst=_runs(out, row0, rows, head_dim), src=out_t)
    return out
