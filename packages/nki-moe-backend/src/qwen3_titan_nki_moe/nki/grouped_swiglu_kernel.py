"""NKI kernels of ``grouped_swiglu``: the routed experts' SwiGLU MLP over the 128-row block layout.

Inputs are the slot rows of ``qwen3_titan_nki_moe.blockwise`` (each expert's rows padded to
whole blocks of 128; ``N`` blocks) and the expert weights **as torchtitan stores them**:
``w1``/``w3`` ``[E, F, D]``, ``w2`` ``[E, D, F]``. The grid is ``(LNC,)``; program ``p`` owns
the intermediate columns ``F_p = p*F/LNC .. (p+1)*F/LNC - 1`` (``Fp = F / LNC`` wide), so no
two programs write the same output element.

Loop structure (every kernel)::

    for e in fori_loop(0, E):                         # at run time
        lo, hi = block_start[e], block_start[e + 1]   # scalar_load from the host's table
        load expert e's F_p weight slices once        # scalar_offset = e on the expert dim
        for n in fori_loop(lo, hi):                   # at run time: expert e's blocks
            ... activations of block n at scalar_offset n ...

so an expert's weights are read once per call however many blocks it has, and what the
compiler emits is one expert body and one block body: the instruction count depends on ``D``
and ``Fp`` only, not on the number of rows, blocks or experts. Traced by the tests' NKI twin
(``test_nki_kernels_cpu``), per program: at Qwen3-30B-A3B (D 2048, F 768, LNC 2) the forward is
374 instructions, the backward 302, the weight gradients 272 (of the first two, 288 and 192
are the per-expert weight transposes: two instructions per 128x128 tile, ``3*Ft*Dt`` and
``2*Ft*Dt`` tiles with ``Ft = Fp/128``, ``Dt = D/128``), the same for any number of rows or
experts; unrolling blocks x F-tiles x D-tiles (384 x 3 x 16), as the earlier version did,
emitted about 10^5 for the forward alone.

The weights are transposed on chip, once per expert: the gate/up GEMMs contract over D, so
they need ``w1``/``w3`` with D on the partitions (``[d, f]`` tiles), and the down GEMM
contracts over F (``w2`` as ``[f, d]`` tiles); each 128x128 tile is DMA-ed in the stored
layout (rows contiguous) and turned with ``nisa.nc_transpose`` (TensorE, bit-accurate on
NeuronCore-v3). The host never copies a weight: the earlier version transposed every
expert's three weights on the host on every call (three ``[E, F, D]`` copies per layer and
forward, 1.2 GB in bf16 at 30B-A3B without expert parallelism, and two more per backward). The backward reads ``w2`` (dh = dy @ w2) and ``w1``/``w3``
(dx = dgate @ w1 + dup @ w3) in the stored layout directly and transposes only for the
recomputed gate/up. The price is TensorE time: the forward's ``3*Ft*Dt`` transposes per expert
are about one 128-row block's matmul work, so at 30B-A3B (4096 tokens x top-8 over 128
experts: 2 blocks per expert on average) a third of the forward's TensorE time. Keeping a
second, transposed copy of the expert weights in step with the optimizer would avoid both the
transposes and the host copies, at twice the experts' memory; ``nisa.dma_transpose`` (2-byte
dtypes) could move the transposes off the TensorE. Neither is done here.

Weight gradients are computed here too (``grouped_swiglu_wgrad_kernel``): per expert, the sum
over its blocks of ``dgate^T @ x``, ``dup^T @ x`` and ``dy^T @ h`` (TensorE, contraction over
the block's 128 rows on the partitions, fp32 accumulation in SBUF). No ``torch._grouped_mm``
runs on the Neuron device: that op's Neuron kernel is not verified.

Rounding follows the reference op (``qwen3_titan::grouped_swiglu``): each GEMM accumulates in
fp32 (PSUM) and is rounded to the input dtype where the reference's GEMM output is
(gate, up, dh); ``silu``, ``h``, ``dup``, ``dh*up`` and ``dgate`` are rounded where the
reference's elementwise ops round. The forward and dX partial sums stay fp32 per program and
the host adds the ``LNC`` parts.

Limits (``qwen3_titan_nki_moe.kernel_limits``; b = bytes per element, per SBUF partition):

- SBUF, single-buffered: forward ``b*(3*Fp*D/128 + 3*D + 5*Fp) + 4*D + 8`` bytes, backward
  ``b*(5*Fp*D/128 + 2*D + 9*Fp) + 4*Fp + 4*D + 8`` (weight gradients: under 20 KiB); each must
  fit the 208 KiB budget of trn2's 224 KiB partition (``kernel_limits.SBUF_BUDGET``). At
  30B-A3B (D 2048, Fp 384): forward 59.8 KiB, backward 84.3 KiB in bf16, 159.0 KiB in fp32.
  The largest Fp at D 2048 is 1024 in bf16 and 512 in fp32; Qwen3-235B-A22B (D 4096, Fp 768)
  does not fit (288.5 KiB in bf16) and takes the reference path. The launcher's shape rule
  checks fp32; the kernel's ``fits`` the run's dtype;
- D and Fp multiples of 128 (TensorE tiles). Experts and rows per call are run-time loop
  bounds, so SBUF and the instruction count set no limit on them; the int32 offsets below do;
- offsets are int32 ``NkiScalar`` values, so every HBM tensor a call addresses stays under 2 GiB
  (``kernel_limits.MAX_HBM_TENSOR_BYTES``): the fp32 partials ``LNC*N*128*D*4`` bytes (N =
  ceil(R/128) + E blocks; at 30B-A3B, LNC 2, 128 experts: up to 114 688 routed rows per call,
  8192 tokens at top-8 use 65 536) and a weight, ``E*F*D*b`` (at most 682 experts of
  30B-A3B's size in bf16, 341 in fp32);
- PSUM: 7 or 8 tiles per kernel, each within one 2 KiB bank (a matmul output is at most 512
  fp32 columns): at most 8.5 KiB of the 16 KiB per partition, 8 banks if each takes its own.

UNTESTED ON HARDWARE (see the package docstring); run on CPU through the tests' NKI twin and,
where the nki package is installed, under ``nki.simulate`` (``tools/run_neuron_tests.py --simulate``).
"""

from __future__ import annotations

from qwen3_titan_nki_moe.nki._lang import MOVING_MAX, P, nisa, nki, nl


def _chunks(size: int, width: int = MOVING_MAX) -> list[tuple[int, int]]:
    """``(start, width)`` pieces of ``size`` no wider than one matmul's moving operand (one PSUM bank)."""
    return [(c0, min(width, size - c0)) for c0 in range(0, size, width)]


def _expert_blocks(block_start_E1, expert):
    """Expert ``expert``'s blocks ``[lo, hi)``, read at run time from the host's ``[E + 1, 1]`` table."""
    lo_t = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    hi_t = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
    for tile, step in ((lo_t, 0), (hi_t, 1)):
        nisa.dma_copy(
            dst=tile,
            src=block_start_E1.ap(
                pattern=[[1, 1], [1, 1]], offset=step, scalar_offset=expert, indirect_dim=0
            ),
        )
    return nisa.scalar_load(lo_t), nisa.scalar_load(hi_t)


def _load_weight(weight, expert, row0: int, row_tiles: int, col0: int, cols: int, dtype):
    """``[128, row_tiles, cols]`` SBUF: ``weight[expert, row0 + kt*128 + p, col0 : col0 + cols]`` at ``[p, kt]``.

    ``weight`` is ``[E, R, C]`` in HBM (rows contiguous); ``expert`` is a run-time scalar on the
    expert dimension. One DMA; each partition reads ``row_tiles`` runs of ``cols`` elements.
    """
    inner = weight.shape[2]
    tile = nl.ndarray((P, row_tiles, cols), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(
        dst=tile,
        src=weight.ap(
            pattern=[[inner, P], [P * inner, row_tiles], [1, cols]],
            offset=row0 * inner + col0,
            scalar_offset=expert,
            indirect_dim=0,
        ),
    )
    return tile


def _transpose_into(dst_T, src, src_tiles: int, dst_tiles: int, dtype):
    """``dst_T[:, j, i*128:(i+1)*128] = src[:, i, j*128:(j+1)*128]^T`` for every 128x128 tile (TensorE)."""
    for i in range(src_tiles):
        for j in range(dst_tiles):
            ps = nl.ndarray((P, P), dtype=dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=ps, data=src[:, i, j * P : (j + 1) * P])
            nisa.tensor_copy(dst=dst_T[:, j, i * P : (i + 1) * P], src=ps)


def _block_columns(x_NDB, n, d_tiles: int, dtype):
    """``[128 (d), D/128, 128 (t)]``: block ``n`` of the ``[N, D, 128]`` transposed slot rows (one DMA)."""
    tile = nl.ndarray((P, d_tiles, P), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(
        dst=tile,
        src=x_NDB.ap(pattern=[[P, P], [P * P, d_tiles], [1, P]], offset=0, scalar_offset=n, indirect_dim=0),
    )
    return tile


def _gate_up(xT, w1T, w3T, d_tiles: int, hidden: int, dtype):
    """``[128 (t), Fp]`` gate and up rows of one block, rounded to ``dtype`` as the reference's GEMMs are."""
    gate = nl.ndarray((P, hidden), dtype=dtype, buffer=nl.sbuf)
    up = nl.ndarray((P, hidden), dtype=dtype, buffer=nl.sbuf)
    for c0, width in _chunks(hidden):
        gate_ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
        up_ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
        for kd in range(d_tiles):
            # stationary x^T [d, t], moving w^T [d, f]: out [t, f] = x @ w^T, contraction over d.
            nisa.nc_matmul(
                dst=gate_ps, stationary=xT[:, kd, :], moving=w1T[:, kd, c0 : c0 + width], accumulate=kd > 0
            )
            nisa.nc_matmul(
                dst=up_ps, stationary=xT[:, kd, :], moving=w3T[:, kd, c0 : c0 + width], accumulate=kd > 0
            )
        nisa.tensor_copy(dst=gate[:, c0 : c0 + width], src=gate_ps)
        nisa.tensor_copy(dst=up[:, c0 : c0 + width], src=up_ps)
    return gate, up


def _columns_T(rows, f_tiles: int, dtype):
    """``[128 (f), Fp/128, 128 (t)]``: the ``[128 (t), Fp]`` tile ``rows`` transposed per 128 columns."""
    out = nl.ndarray((P, f_tiles, P), dtype=dtype, buffer=nl.sbuf)
    for kf in range(f_tiles):
        ps = nl.ndarray((P, P), dtype=dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=ps, data=rows[:, kf * P : (kf + 1) * P])
        nisa.tensor_copy(dst=out[:, kf, :], src=ps)
    return out


def _store_block(parts, tile, n, pid: int, blocks: int, dim: int):
    """``parts[pid, n] = tile``: ``parts`` is ``[LNC, N, 128, D]`` fp32, ``n`` a run-time block index."""
    nisa.dma_copy(
        dst=parts.ap(
            pattern=[[dim, P], [1, dim]], offset=pid * blocks * P * dim, scalar_offset=n, indirect_dim=1
        ),
        src=tile,
    )


def _store_columns(out_NBF, tile, n, col0: int, cols: int):
    """``out_NBF[n, :, col0 : col0 + cols] = tile`` (``[N, 128, F]`` in HBM, ``n`` at run time)."""
    hidden = out_NBF.shape[2]
    nisa.dma_copy(
        dst=out_NBF.ap(pattern=[[hidden, P], [1, cols]], offset=col0, scalar_offset=n, indirect_dim=0),
        src=tile,
    )


@nki.jit
def grouped_swiglu_fwd_kernel(x_NDB, block_start_E1, w1_EFD, w3_EFD, w2_EDF):
    """x_NDB [N, D, 128] (blockwise.block_columns); block_start_E1 [E + 1, 1] int32; weights as stored.

    Returns ``y_parts`` ``[LNC, N, 128, D]`` fp32: program ``p``'s partial sum over its ``F_p``.
    """
    blocks, dim, _ = x_NDB.shape
    experts, hidden_all, _ = w1_EFD.shape
    dtype = x_NDB.dtype
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    hidden = hidden_all // lnc
    f_lo = pid * hidden
    d_tiles, f_tiles = dim // P, hidden // P
    y_parts = nl.ndarray((lnc, blocks, P, dim), dtype=nl.float32, buffer=nl.shared_hbm)

    def expert_body(e):
        lo, hi = _expert_blocks(block_start_E1, e)
        # Resident for all of expert e's blocks: w1^T, w3^T as [d, f] tiles, w2^T as [f, d] tiles.
        w1T = nl.ndarray((P, d_tiles, hidden), dtype=dtype, buffer=nl.sbuf)
        w3T = nl.ndarray((P, d_tiles, hidden), dtype=dtype, buffer=nl.sbuf)
        w2T = nl.ndarray((P, f_tiles, dim), dtype=dtype, buffer=nl.sbuf)
        for kf in range(f_tiles):  # one [f, D] row tile at a time: the staging stays D wide
            w1_rows = _load_weight(w1_EFD, e, f_lo + kf * P, 1, 0, dim, dtype)
            _transpose_into(w1T[:, :, kf * P : (kf + 1) * P], w1_rows, 1, d_tiles, dtype)
            w3_rows = _load_weight(w3_EFD, e, f_lo + kf * P, 1, 0, dim, dtype)
            _transpose_into(w3T[:, :, kf * P : (kf + 1) * P], w3_rows, 1, d_tiles, dtype)
        for kd in range(d_tiles):  # one [d, Fp] row tile of w2 at a time
            w2_rows = _load_weight(w2_EDF, e, kd * P, 1, f_lo, hidden, dtype)
            _transpose_into(w2T[:, :, kd * P : (kd + 1) * P], w2_rows, 1, f_tiles, dtype)

        def block_body(n):
            xT = _block_columns(x_NDB, n, d_tiles, dtype)
            gate, up = _gate_up(xT, w1T, w3T, d_tiles, hidden, dtype)
            h = nl.ndarray((P, hidden), dtype=dtype, buffer=nl.sbuf)
            nisa.activation(dst=h, op=nl.silu, data=gate)  # silu(gate), rounded like F.silu's output
            nisa.tensor_tensor(dst=h, data1=h, data2=up, op=nl.multiply)
            hT = _columns_T(h, f_tiles, dtype)
            y = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
            for c0, width in _chunks(dim):
                y_ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
                for kf in range(f_tiles):
                    # stationary h^T [f, t], moving w2^T [f, d]: out [t, d], contraction over f.
                    nisa.nc_matmul(
                        dst=y_ps,
                        stationary=hT[:, kf, :],
                        moving=w2T[:, kf, c0 : c0 + width],
                        accumulate=kf > 0,
                    )
                nisa.tensor_copy(dst=y[:, c0 : c0 + width], src=y_ps)
            _store_block(y_parts, y, n, pid, blocks, dim)

        nl.fori_loop(lo, hi, block_body)

    nl.fori_loop(0, experts, expert_body)
    return y_parts


@nki.jit
def grouped_swiglu_bwd_kernel(x_NDB, dy_NDB, block_start_E1, w1_EFD, w3_EFD, w2_EDF):
    """Recompute + backward of one call. Inputs as the forward's, ``dy_NDB`` the output gradient likewise.

    Returns ``dx_parts`` ``[LNC, N, 128, D]`` fp32 partials, and ``h``, ``dgate``, ``dup``
    ``[N, 128, F]`` in the input dtype (for ``grouped_swiglu_wgrad_kernel``).
    """
    blocks, dim, _ = x_NDB.shape
    experts, hidden_all, _ = w1_EFD.shape
    dtype = x_NDB.dtype
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    hidden = hidden_all // lnc
    f_lo = pid * hidden
    d_tiles, f_tiles = dim // P, hidden // P
    dx_parts = nl.ndarray((lnc, blocks, P, dim), dtype=nl.float32, buffer=nl.shared_hbm)
    h_NBF = nl.ndarray((blocks, P, hidden_all), dtype=dtype, buffer=nl.shared_hbm)
    dgate_NBF = nl.ndarray((blocks, P, hidden_all), dtype=dtype, buffer=nl.shared_hbm)
    dup_NBF = nl.ndarray((blocks, P, hidden_all), dtype=dtype, buffer=nl.shared_hbm)

    def expert_body(e):
        lo, hi = _expert_blocks(block_start_E1, e)
        # Stored layouts, read directly: w1/w3 [f, d] tiles for dx, w2 [d, f] tiles for dh.
        w1_s = _load_weight(w1_EFD, e, f_lo, f_tiles, 0, dim, dtype)
        w3_s = _load_weight(w3_EFD, e, f_lo, f_tiles, 0, dim, dtype)
        w2_s = _load_weight(w2_EDF, e, 0, d_tiles, f_lo, hidden, dtype)
        # Transposed for the recomputed gate/up.
        w1T = nl.ndarray((P, d_tiles, hidden), dtype=dtype, buffer=nl.sbuf)
        w3T = nl.ndarray((P, d_tiles, hidden), dtype=dtype, buffer=nl.sbuf)
        _transpose_into(w1T, w1_s, f_tiles, d_tiles, dtype)
        _transpose_into(w3T, w3_s, f_tiles, d_tiles, dtype)

        def block_body(n):
            xT = _block_columns(x_NDB, n, d_tiles, dtype)
            dyT = _block_columns(dy_NDB, n, d_tiles, dtype)
            gate, up = _gate_up(xT, w1T, w3T, d_tiles, hidden, dtype)
            dh = nl.ndarray((P, hidden), dtype=dtype, buffer=nl.sbuf)
            for c0, width in _chunks(hidden):
                dh_ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
                for kd in range(d_tiles):
                    # stationary dy^T [d, t], moving w2 [d, f]: dh [t, f] = dy @ w2, contraction over d.
                    nisa.nc_matmul(
                        dst=dh_ps,
                        stationary=dyT[:, kd, :],
                        moving=w2_s[:, kd, c0 : c0 + width],
                        accumulate=kd > 0,
                    )
                nisa.tensor_copy(dst=dh[:, c0 : c0 + width], src=dh_ps)
            silu = nl.ndarray((P, hidden), dtype=dtype, buffer=nl.sbuf)
            nisa.activation(dst=silu, op=nl.silu, data=gate)
            h = nl.ndarray((P, hidden), dtype=dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=h, data1=silu, data2=up, op=nl.multiply)
            dup = nl.ndarray((P, hidden), dtype=dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dup, data1=dh, data2=silu, op=nl.multiply)
            # dgate = (dh * up) * silu'(gate): dh * up is rounded (a tensor op in the reference),
            # then aten's silu_backward rounds once, after the product with the slope.
            slope = nl.ndarray((P, hidden), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=slope, op=nl.silu_dx, data=gate)
            dgate = nl.ndarray((P, hidden), dtype=dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dgate, data1=dh, data2=up, op=nl.multiply)
            nisa.tensor_tensor(dst=dgate, data1=dgate, data2=slope, op=nl.multiply)
            for out_NBF, tile in ((h_NBF, h), (dgate_NBF, dgate), (dup_NBF, dup)):
                _store_columns(out_NBF, tile, n, f_lo, hidden)
            dgateT = _columns_T(dgate, f_tiles, dtype)
            dupT = _columns_T(dup, f_tiles, dtype)
            dx = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
            for c0, width in _chunks(dim):
                dx_ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
                for kf in range(f_tiles):
                    # stationary dgate^T [f, t], moving w1 [f, d]: dx [t, d], contraction over f.
                    nisa.nc_matmul(
                        dst=dx_ps,
                        stationary=dgateT[:, kf, :],
                        moving=w1_s[:, kf, c0 : c0 + width],
                        accumulate=kf > 0,
                    )
                    nisa.nc_matmul(
                        dst=dx_ps,
                        stationary=dupT[:, kf, :],
                        moving=w3_s[:, kf, c0 : c0 + width],
                        accumulate=True,
                    )
                nisa.tensor_copy(dst=dx[:, c0 : c0 + width], src=dx_ps)
            _store_block(dx_parts, dx, n, pid, blocks, dim)

        nl.fori_loop(lo, hi, block_body)

    nl.fori_loop(0, experts, expert_body)
    return dx_parts, h_NBF, dgate_NBF, dup_NBF


@nki.jit
def grouped_swiglu_wgrad_kernel(x_NBD, dy_NBD, h_NBF, dgate_NBF, dup_NBF, block_start_E1):
    """Weight gradients from one call's slot rows: ``x``/``dy`` ``[N, 128, D]`` (blockwise.block_rows),
    ``h``/``dgate``/``dup`` ``[N, 128, F]`` (the backward kernel's outputs).

    Returns ``dw1``, ``dw3`` ``[E, F, D]`` and ``dw2`` ``[E, D, F]`` in the input dtype; program
    ``p`` writes its ``F_p`` rows (columns of ``dw2``).
    """
    blocks, _, dim = x_NBD.shape
    hidden_all = h_NBF.shape[2]
    experts = block_start_E1.shape[0] - 1
    dtype = x_NBD.dtype
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    hidden = hidden_all // lnc
    f_lo = pid * hidden
    d_tiles, f_tiles = dim // P, hidden // P
    dw1 = nl.ndarray((experts, hidden_all, dim), dtype=dtype, buffer=nl.shared_hbm)
    dw3 = nl.ndarray((experts, hidden_all, dim), dtype=dtype, buffer=nl.shared_hbm)
    dw2 = nl.ndarray((experts, dim, hidden_all), dtype=dtype, buffer=nl.shared_hbm)

    def rows(src_NBX, n, col0: int, cols: int):
        """``[128 (t), cols]``: block ``n``'s rows of ``src_NBX`` ``[N, 128, X]``, columns ``col0 ..``."""
        inner = src_NBX.shape[2]
        tile = nl.ndarray((P, cols), dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(
            dst=tile,
            src=src_NBX.ap(pattern=[[inner, P], [1, cols]], offset=col0, scalar_offset=n, indirect_dim=0),
        )
        return tile

    def store(dw, acc, e, row0: int, col0: int, cols: int):
        """``dw[e, row0 : row0 + 128, col0 : col0 + cols] = acc`` rounded to the input dtype."""
        inner = dw.shape[2]
        out = nl.ndarray((P, cols), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=acc)
        nisa.dma_copy(
            dst=dw.ap(
                pattern=[[inner, P], [1, cols]], offset=row0 * inner + col0, scalar_offset=e, indirect_dim=0
            ),
            src=out,
        )

    def expert_body(e):
        lo, hi = _expert_blocks(block_start_E1, e)
        for kf in range(f_tiles):
            f0 = f_lo + kf * P
            for c0, width in _chunks(dim):
                # dw1[e][f, d] = sum_t dgate[t, f] x[t, d]: stationary dgate [t, f], moving x [t, d].
                acc1 = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
                acc3 = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=acc1, value=0.0)
                nisa.memset(dst=acc3, value=0.0)

                def body(n, f0=f0, c0=c0, width=width, acc1=acc1, acc3=acc3):
                    x_t = rows(x_NBD, n, c0, width)
                    for acc, grad_NBF in ((acc1, dgate_NBF), (acc3, dup_NBF)):
                        g_t = rows(grad_NBF, n, f0, P)
                        ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
                        nisa.nc_matmul(dst=ps, stationary=g_t, moving=x_t, accumulate=False)
                        nisa.tensor_tensor(dst=acc, data1=acc, data2=ps, op=nl.add)

                nl.fori_loop(lo, hi, body)
                store(dw1, acc1, e, f0, c0, width)
                store(dw3, acc3, e, f0, c0, width)
        for kd in range(d_tiles):
            for c0, width in _chunks(hidden):
                # dw2[e][d, f] = sum_t dy[t, d] h[t, f]: stationary dy [t, d], moving h [t, f].
                acc2 = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=acc2, value=0.0)

                def body2(n, kd=kd, c0=c0, width=width, acc2=acc2):
                    dy_t = rows(dy_NBD, n, kd * P, P)
                    h_t = rows(h_NBF, n, f_lo + c0, width)
                    ps = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(dst=ps, stationary=dy_t, moving=h_t, accumulate=False)
                    nisa.tensor_tensor(dst=acc2, data1=acc2, data2=ps, op=nl.add)

                nl.fori_loop(lo, hi, body2)
                store(dw2, acc2, e, kd * P, f_lo + c0, width)

    nl.fori_loop(0, experts, expert_body)
    return dw1, dw3, dw2
