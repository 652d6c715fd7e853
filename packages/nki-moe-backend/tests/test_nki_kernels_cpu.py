"""The NKI kernels' own source, run on CPU, against the reference ops.

Each test runs twice: on the tests' CPU twin of NKI (``fake_nki_twin_no_trainium``: no Trainium
and no Neuron ``nki`` package here), and under the real ``nki.simulate`` where that package is
installed (``-m nki_simulator``; ``tools/run_neuron_tests.py --simulate``). On the twin the
tests also check each kernel's SBUF footprint against ``kernel_limits`` (the arithmetic in the
docstrings) and that the grouped SwiGLU kernels' instruction count does not grow with the data.
"""

import pytest
import torch
from nki_kernel_runners import SIMULATOR, TWIN, runner
from qwen3_titan_common.train.tolerance import assert_close_reduction
from qwen3_titan_nki_moe import (
    blockwise,
    kernel_limits,
    registry,  # noqa: F401  (registers the reference ops)
)
from reduction_bounds import grouped_swiglu_bounds, rms_norm_bounds

OPS = torch.ops.qwen3_titan
RUNNERS = [TWIN, pytest.param(SIMULATOR, marks=pytest.mark.nki_simulator)]


@pytest.fixture(params=RUNNERS)
def kernels(request):
    with runner(request.param) as r:
        yield r


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# rms_norm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_kernels(kernels, dtype):
    lnc, dim = 2, 640  # 640: one 512-column chunk and one of 128 in the dw reduction
    x = _randn(512, dim, dtype=dtype, seed=0)  # 2 row tiles per program
    w = (1 + 0.1 * _randn(1, dim, dtype=torch.float32, seed=1)).to(dtype)
    grad = _randn(512, dim, dtype=dtype, seed=2)
    module = kernels.module("rms_norm_kernel")

    y = kernels.run(module.rms_norm_fwd_kernel, lnc, x, w, 1e-6)
    measure = kernels.measure()
    grad_x, grad_w_parts = kernels.run(module.rms_norm_bwd_kernel, lnc, grad, x, w, 1e-6)
    want_y = OPS.rms_norm(x, w.view(-1), 1e-6)
    want_dx, want_dw = OPS.rms_norm_backward(grad, x, w.view(-1), 1e-6)

    got = {"y": y, "dx": grad_x, "dw": grad_w_parts.sum(0).to(dtype)}
    want = {"y": want_y, "dx": want_dx, "dw": want_dw}
    if dtype == torch.float32:  # fp32 sums in another order (dw: over the 512 rows), at the derived bound
        for name, (n_terms, abs_sum, carried) in rms_norm_bounds(x, w, grad, 1e-6).items():
            assert_close_reduction(got[name], want[name], n_terms, abs_sum, atol=carried, name=name)
    else:  # the kernel rounds where torch.rms_norm does; statistics summed in another order
        for name in got:
            torch.testing.assert_close(got[name], want[name], atol=1e-2, rtol=1e-2)
    if measure is not None:
        itemsize = x.element_size()
        assert measure.footprint("sbuf") == kernel_limits.rms_norm_forward_bytes(dim, itemsize, itemsize)
        assert kernels.measure().footprint("sbuf") == kernel_limits.rms_norm_backward_bytes(
            dim, itemsize, itemsize
        )


# rope_hf ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("head_dim", "cos_batch"), [(96, 1), (256, 2)])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_rope_hf_kernel(kernels, dtype, head_dim, cos_batch, backward):
    # head_dim 256: over the earlier 128 limit (head_dim is on the free axis now).
    lnc, batch, heads, seq = 2, 2, 3, 1024
    x = _randn(batch, heads, seq, head_dim, dtype=dtype, seed=3)
    angle = _randn(cos_batch, seq, head_dim // 2, dtype=torch.float32, seed=4).repeat(1, 1, 2)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    tiles = seq // (kernel_limits.PARTITIONS * lnc)
    rows = kernel_limits.rope_rows_per_partition(tiles, head_dim, x.element_size())
    module = kernels.module("rope_hf_kernel")

    out = kernels.run(module.rope_hf_kernel, lnc, x, cos, sin, backward, rows)
    if backward:
        want = OPS.rope_hf_backward(x, x, cos, sin)[0]
    else:
        want = OPS.rope_hf(x, x, cos, sin)[0]
    # Same products and sums, each rounded to the dtype, in transformers' order: bit for bit.
    assert torch.equal(out, want)
    measure = kernels.measure()
    if measure is not None:
        assert rows > 1  # several 128-position tiles per transfer
        assert measure.footprint("sbuf") == kernel_limits.rope_hf_bytes(head_dim, rows, x.element_size())


# grouped_swiglu ---------------------------------------------------------------------------


def _experts(dtype, counts, dim, hidden, seed=5):
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    rows, num = int(offsets[-1]), len(counts)
    x = _randn(rows, dim, dtype=dtype, seed=seed, scale=0.5)
    w1 = _randn(num, hidden, dim, dtype=dtype, seed=seed + 1, scale=0.05)
    w3 = _randn(num, hidden, dim, dtype=dtype, seed=seed + 2, scale=0.05)
    w2 = _randn(num, dim, hidden, dtype=dtype, seed=seed + 3, scale=0.05)
    grad = _randn(rows, dim, dtype=dtype, seed=seed + 4)
    return x, w1, w3, w2, offsets, grad


def _run_grouped_swiglu(kernels, lnc, x, w1, w3, w2, offsets, grad):
    """The three kernels on the block layout, as ``nki.grouped_swiglu`` launches them."""
    module = kernels.module("grouped_swiglu_kernel")
    layout = blockwise.block_layout(offsets, x.shape[0])
    x_SD = blockwise.to_blocks(x, layout)
    dy_SD = blockwise.to_blocks(grad, layout)
    args = (layout.block_start_E1, w1, w3, w2)
    y_parts = kernels.run(module.grouped_swiglu_fwd_kernel, lnc, blockwise.block_columns(x_SD), *args)
    fwd = kernels.measure()
    dx_parts, h, dgate, dup = kernels.run(
        module.grouped_swiglu_bwd_kernel,
        lnc,
        blockwise.block_columns(x_SD),
        blockwise.block_columns(dy_SD),
        *args,
    )
    bwd = kernels.measure()
    dw1, dw3, dw2 = kernels.run(
        module.grouped_swiglu_wgrad_kernel,
        lnc,
        blockwise.block_rows(x_SD),
        blockwise.block_rows(dy_SD),
        h,
        dgate,
        dup,
        layout.block_start_E1,
    )
    wgrad = kernels.measure()
    for out in (y_parts, dx_parts, h, dgate, dup, dw1, dw3, dw2):
        assert torch.isfinite(out).all()  # every slot written (the twin fills fresh memory with NaN)
    y = blockwise.from_blocks(y_parts.sum(0).reshape(x_SD.shape).to(x.dtype), layout)
    dx = blockwise.from_blocks(dx_parts.sum(0).reshape(x_SD.shape).to(x.dtype), layout)
    return (y, dx, dw1, dw3, dw2), (fwd, bwd, wgrad)


def _reference(x, w1, w3, w2, offsets, grad):
    y, gate, up = OPS.grouped_swiglu(x, w1, w3, w2, offsets)
    dx, dw1, dw3, dw2 = OPS.grouped_swiglu_backward(grad, None, None, x, w1, w3, w2, offsets, gate, up)
    return y, dx, dw1, dw3, dw2


def _assert_grouped_swiglu_close(got, want, dtype, *inputs):
    names = ("y", "dx", "dw1", "dw3", "dw2")
    if dtype == torch.float32:
        bounds = grouped_swiglu_bounds(*inputs)
        for name, a, b in zip(names, got, want, strict=True):
            n_terms, abs_sum, carried = bounds[name]
            assert_close_reduction(a, b, n_terms, abs_sum, atol=carried, name=name)
    else:
        for name, a, b in zip(names, got, want, strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_swiglu_kernels(kernels, dtype):
    lnc, dim, hidden = 2, 256, 512
    # Experts with 0, 1, 2 blocks; rows past offsets[-1] would read the zero slot.
    x, w1, w3, w2, offsets, grad = _experts(dtype, (130, 0, 1, 250, 0), dim, hidden)
    got, measures = _run_grouped_swiglu(kernels, lnc, x, w1, w3, w2, offsets, grad)
    want = _reference(x, w1, w3, w2, offsets, grad)
    # fp32: GEMMs accumulate in another order, at the derived bound. bf16: rounded where the reference
    # rounds, but dx and the weight gradients are summed in fp32 before the one rounding the reference
    # does twice.
    _assert_grouped_swiglu_close(got, want, dtype, x, w1, w3, w2, offsets, grad)
    if measures[0] is not None:
        itemsize, per_core = x.element_size(), hidden // lnc
        fwd, bwd, wgrad = (m.footprint("sbuf") for m in measures)
        assert fwd == kernel_limits.grouped_swiglu_forward_bytes(dim, per_core, itemsize)
        assert bwd == kernel_limits.grouped_swiglu_backward_bytes(dim, per_core, itemsize)
        assert wgrad == kernel_limits.grouped_swiglu_wgrad_bytes(dim, per_core, itemsize)
        for m in measures:  # every PSUM tile within a bank (the twin checks), one bank each at worst
            assert len(m.sites["psum"]) <= kernel_limits.PSUM_PARTITION_BYTES // kernel_limits.PSUM_BANK_BYTES


def test_grouped_swiglu_kernels_with_partial_chunks():
    # D 640 and Fp 640: every matmul loop ends on a 128-wide chunk after a 512-wide one.
    with runner(TWIN) as kernels:
        x, w1, w3, w2, offsets, grad = _experts(torch.float32, (200, 57), 640, 1280, seed=11)
        got, _ = _run_grouped_swiglu(kernels, 2, x, w1, w3, w2, offsets, grad)
    want = _reference(x, w1, w3, w2, offsets, grad)
    _assert_grouped_swiglu_close(got, want, torch.float32, x, w1, w3, w2, offsets, grad)


def _instructions(counts, dim, hidden, lnc=2):
    with runner(TWIN) as kernels:
        x, w1, w3, w2, offsets, grad = _experts(torch.bfloat16, counts, dim, hidden, seed=13)
        _, measures = _run_grouped_swiglu(kernels, lnc, x, w1, w3, w2, offsets, grad)
    return [m.instructions for m in measures]


def test_grouped_swiglu_instruction_count_does_not_grow_with_rows_or_experts():
    # Every expert has a block, so every loop body is traced (a body is emitted once).
    small = _instructions((3, 1), dim=256, hidden=512)
    large = _instructions((300, 129, 7, 1, 640), dim=256, hidden=512)
    assert small == large


def test_grouped_swiglu_instruction_count_at_the_30b_a3b_shape():
    # hidden 2048, moe_intermediate 768, LNC 2; two experts suffice (the count does not depend on them).
    fwd, bwd, wgrad = _instructions((129, 5), dim=2048, hidden=768)
    print(f"instructions per program at 30B-A3B: forward {fwd}, backward {bwd}, weight gradients {wgrad}")
    # Unrolling blocks x F-tiles x D-tiles (384 x 3 x 16) emitted about 1e5 for the forward alone.
    assert fwd < 1000 and bwd < 1000 and wgrad < 1000
