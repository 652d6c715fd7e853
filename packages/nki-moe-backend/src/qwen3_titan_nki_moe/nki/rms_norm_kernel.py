"""NKI kernels of ``rms_norm``: RMSNorm over the last dimension, forward and backward.

Rows (every leading dimension flattened) go 128 to a tile, one row per partition; the grid is
``(LNC,)`` and program ``p`` takes row tiles ``p*T .. p*T+T-1`` (``T = rows / (128*LNC)``).
Statistics are fp32::

    rstd = 1 / sqrt(mean(x^2) + eps)         y  = (x * rstd) -> dtype, * weight -> dtype
    g'   = g * rstd * w                      dx = g' - x * (rstd^2 * mean(g' * x))
    dw   = sum over rows of g * x * rstd

(``dx`` is ``rstd * (g*w - x_hat * mean(g*w*x_hat))`` with ``x_hat = x*rstd`` regrouped so that
no ``x_hat`` tile is kept.) ``dw`` is reduced across the 128 partitions with a ones-vector
matmul (TensorE) into PSUM and accumulated in fp32 per program (``[LNC, D]``); the host adds
the programs' parts. The weight row is DMA-ed onto all 128 partitions directly (a stride-0
HBM read), in its own dtype: exact, no broadcast matmul.

``rsqrt`` runs on the GpSimd Engine (``nisa.tensor_scalar(op0=nl.rsqrt, engine=gpsimd)``): the
NKI docs' "engine selection" table names it the higher-precision engine for reverse square
root (Scalar Engine's ``activation(nl.rsqrt)`` is 4x faster, less precise); on a ``[128, 1]``
tile the speed does not matter. The valid input range is ``[2^-87, 2^97]``: ``mean(x^2) + eps``
with ``eps >= 2^-87``.

Limits (b = bytes per element of x and grad, bw of the weight; per SBUF partition,
``qwen3_titan_nki_moe.kernel_limits``, checked against the kernels' allocations by the tests):

- forward ``D*(4 + 2*b + bw) + 12`` bytes: x, its fp32 square, y, the weight row, and the
  sum/mean/rstd columns;
- backward ``D*(12 + 2*b + bw) + 24`` bytes: x, g, two fp32 scratch rows (x^2, then g*x*rstd,
  then g'*x; and g'), the weight row, the fp32 ``[1, D]`` dw accumulator (its address range is
  taken on every partition) and six ``[128, 1]`` columns. The earlier version held nine fp32
  ``[128, D]`` temporaries and an fp32 weight row: 40*D bytes, 320 KiB at D = 8192, over trn2's
  224 KiB partition;
- so D <= ``MAX_NORM_DIM`` = 8192: 24 * 8192 + 24 bytes = 192 KiB in fp32, inside the 208 KiB
  budget (trn2's 224 KiB less the 16 KiB the NKI library keeps free). 16384 would need 384 KiB;
- rows a multiple of 128*LNC (the row tiles split over the cores), and no other limit: offsets are
  static, SBUF holds one tile of rows at a time. The row-tile loop is
  static (unrolled) for the compiler to pipeline: 7 instructions per tile forward and
  ``13 + 2*ceil(D/512)`` backward (21 at D 2048), ``rows / (128*LNC)`` tiles per program
  (16 for 4096 rows at LNC 2: 113 forward, 340 backward);
- the weight gradient's fp32 ones-vector matmul and the GpSimd rsqrt are the precision-relevant
  steps; the fp32 Trainium test tolerance (``tests/test_nki_neuron.py``) is 1e-4.

UNTESTED ON HARDWARE (see the package docstring).
"""

from __future__ import annotations

from qwen3_titan_nki_moe.nki._lang import MOVING_MAX, P, nisa, nki, nl


def _weight_rows(weight, dim: int):
    """``weight`` ``[1, D]`` (HBM) on all 128 partitions, in its own dtype: one stride-0 DMA."""
    w_rows = nl.ndarray((P, dim), dtype=weight.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_rows, src=weight.broadcast(0, P))
    return w_rows


def _rstd(x_t, scratch, dim: int, eps: float):
    """fp32 ``[128, 1]``: ``1 / sqrt(mean(x^2) + eps)`` per row; ``scratch`` (fp32 ``[128, D]``) gets x^2."""
    sum_sq = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(
        dst=scratch,
        op=nl.square,
        data=x_t,
        reduce_op=nl.add,
        reduce_res=sum_sq,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
    )
    mean_sq = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(
        dst=mean_sq, data=sum_sq, op0=nl.multiply, operand0=1.0 / dim, op1=nl.add, operand1=eps
    )
    rstd = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=mean_sq, op0=nl.rsqrt, operand0=0.0, engine=nisa.engine.gpsimd)
    return rstd


@nki.jit
def rms_norm_fwd_kernel(x, weight, eps: float):
    """x ``[rows, D]``, weight ``[1, D]`` -> y ``[rows, D]`` (x's dtype)."""
    rows, dim = x.shape
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    tiles = rows // (P * lnc)
    y = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    w_rows = _weight_rows(weight, dim)
    for t in range(tiles):
        r0 = (pid * tiles + t) * P
        x_t = nl.ndarray((P, dim), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_t, src=x[nl.ds(r0, P), :])
        scratch = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        rstd = _rstd(x_t, scratch, dim, eps)
        y_t = nl.ndarray((P, dim), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y_t, data=x_t, op0=nl.multiply, operand0=rstd)  # x_hat, rounded to x's dtype
        nisa.tensor_tensor(dst=y_t, data1=y_t, data2=w_rows, op=nl.multiply)
        nisa.dma_copy(dst=y[nl.ds(r0, P), :], src=y_t)
    return y


@nki.jit
def rms_norm_bwd_kernel(grad, x, weight, eps: float):
    """grad, x ``[rows, D]``; weight ``[1, D]`` -> grad_x ``[rows, D]``, grad_w parts ``[LNC, D]`` fp32."""
    rows, dim = x.shape
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    tiles = rows // (P * lnc)
    grad_x = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    grad_w_parts = nl.ndarray((lnc, dim), dtype=nl.float32, buffer=nl.shared_hbm)
    w_rows = _weight_rows(weight, dim)
    ones = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    grad_w = nl.ndarray((1, dim), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=grad_w, value=0.0)

    for t in range(tiles):  # grad_w accumulates across the tiles
        r0 = (pid * tiles + t) * P
        x_t = nl.ndarray((P, dim), dtype=x.dtype, buffer=nl.sbuf)
        g_t = nl.ndarray((P, dim), dtype=grad.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=x_t, src=x[nl.ds(r0, P), :])
        nisa.dma_copy(dst=g_t, src=grad[nl.ds(r0, P), :])
        scratch = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        rstd = _rstd(x_t, scratch, dim, eps)

        # dw += ones^T @ (g * x * rstd): the sum over this tile's 128 rows.
        nisa.scalar_tensor_tensor(
            dst=scratch, data=x_t, op0=nl.multiply, operand0=rstd, op1=nl.multiply, operand1=g_t
        )
        for c0 in range(0, dim, MOVING_MAX):
            width = min(MOVING_MAX, dim - c0)
            ps = nl.ndarray((1, width), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps, stationary=ones, moving=scratch[:, c0 : c0 + width], accumulate=False)
            nisa.tensor_tensor(
                dst=grad_w[:, c0 : c0 + width], data1=grad_w[:, c0 : c0 + width], data2=ps, op=nl.add
            )

        # g' = g * rstd * w (fp32); coef = rstd^2 * mean(g' * x); dx = g' - x * coef.
        g_scaled = nl.ndarray((P, dim), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(
            dst=g_scaled, data=g_t, op0=nl.multiply, operand0=rstd, op1=nl.multiply, operand1=w_rows
        )
        dot = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=scratch, data1=g_scaled, data2=x_t, op=nl.multiply)
        nisa.tensor_reduce(dst=dot, op=nl.add, data=scratch, axis=1)
        coef = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(
            dst=coef, data=rstd, op0=nl.multiply, operand0=1.0 / dim, op1=nl.multiply, operand1=rstd
        )
        nisa.tensor_tensor(dst=coef, data1=coef, data2=dot, op=nl.multiply)
        # x * coef - g', reversed: g' - x * coef, written over x (rounded to its dtype once).
        nisa.scalar_tensor_tensor(
            dst=x_t,
            data=x_t,
            op0=nl.multiply,
            operand0=coef,
            op1=nl.subtract,
            operand1=g_scaled,
            reverse1=True,
        )
        nisa.dma_copy(dst=grad_x[nl.ds(r0, P), :], src=x_t)
    nisa.dma_copy(dst=grad_w_parts[nl.ds(pid, 1), :], src=grad_w)
    return grad_x, grad_w_parts
