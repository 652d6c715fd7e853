"""How the kernels are launched from PyTorch: a tuple grid, one wrapped callable per kernel, autograd.

``kernel_launch`` is pure Python (tested directly). The ``qwen3_titan_nki_moe.nki`` modules need
torch-neuronx and nki; here they run on the tests' twins of both (``fake_nki_twin_no_trainium``:
no Trainium, no Neuron SDK on this machine), whose ``wrap_nki`` refuses a bare-int grid the way
one torch-neuronx version does (``tuple(map(int, grid))``).
"""

import fake_nki_twin_no_trainium as twin
import pytest
import torch
from qwen3_titan_common.train.tolerance import assert_close_reduction
from qwen3_titan_nki_moe import registry  # noqa: F401  (registers the reference ops)
from qwen3_titan_nki_moe.kernel_launch import KernelLaunchers, launch_grid
from reduction_bounds import grouped_swiglu_bounds, rms_norm_bounds

OPS = torch.ops.qwen3_titan


def test_the_grid_is_a_tuple_of_the_logical_core_size():
    assert launch_grid(2) == (2,)
    assert launch_grid("1") == (1,)
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG"):
        launch_grid(0)


def test_each_kernel_is_wrapped_once_per_core_size():
    wrapped = []

    class Wrapped:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return (self.kernel, grid)

    def wrap(kernel):
        wrapped.append(kernel)
        return Wrapped(kernel)

    launchers = KernelLaunchers(wrap)
    first, second = object(), object()
    assert launchers(first, 2) == (first, (2,))
    assert launchers(first, 2) is launchers(first, 2)
    assert launchers(second, 2) == (second, (2,))
    assert launchers(first, 1) == (first, (1,))
    assert wrapped == [first, second, first] and len(launchers) == 3


def test_the_twin_of_wrap_nki_refuses_an_int_grid():
    # What the tuple grid guards against: this torch-neuronx version's __getitem__.
    with twin.installed() as neuronx:
        caller = neuronx.wrap_nki(twin.FakeKernel(lambda x: x))
        with pytest.raises(TypeError, match="not iterable"):
            caller[2]


@pytest.fixture
def on_the_twins(monkeypatch):
    """The torch-side NKI modules on the twins, with CPU tensors accepted as Neuron ones."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with twin.installed() as neuronx:
        modules = {}

        def load(name):
            module = twin.import_kernel_module(name)
            monkeypatch.setattr(module, "on_neuron", lambda *tensors: True)
            modules[name] = module
            return module

        yield neuronx, load


def _grads(out, inputs, grads):
    return torch.autograd.grad(out, inputs, grads)


def test_rope_hf_op_launches_on_a_tuple_grid_and_wraps_once(on_the_twins):
    neuronx, load = on_the_twins
    module = load("rope_hf")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 256, 192, generator=g).bfloat16().requires_grad_()
    k = torch.randn(1, 2, 256, 192, generator=g).bfloat16().requires_grad_()
    angle = torch.randn(1, 256, 96, generator=g).repeat(1, 1, 2)
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    for _ in range(3):
        got = module.rope_hf(q, k, cos, sin)
    want = OPS.rope_hf(q, k, cos, sin)
    grads = [torch.randn_like(t) for t in want]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_grads(got, (q, k), grads), _grads(want, (q, k), grads), strict=True):
        assert torch.equal(a, b)
    # Six launches forward (q and k, three calls) and two backward, one wrap_nki: the kernel's.
    assert neuronx.wrapped == [module.rope_hf_kernel]
    assert neuronx.grids == [(2,)]


def test_rms_norm_op_on_the_twins_matches_the_reference(on_the_twins):
    neuronx, load = on_the_twins
    module = load("rms_norm")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 256, 384, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(384, generator=g)).requires_grad_()
    got = module.rms_norm(x, w, 1e-6)
    want = OPS.rms_norm(x, w, 1e-6)
    grad = torch.randn_like(want)
    # fp32 sums in other orders than the reference's (the weight's gradient: over 512 rows), at the derived bound.
    bounds = rms_norm_bounds(x, w, grad, 1e-6)
    got_all, want_all = (got, *_grads(got, (x, w), grad)), (want, *_grads(want, (x, w), grad))
    for name, a, b in zip(("y", "dx", "dw"), got_all, want_all, strict=True):
        n_terms, abs_sum, carried = bounds[name]
        assert_close_reduction(a, b, n_terms, abs_sum, atol=carried, name=name)
    assert neuronx.wrapped == [module.rms_norm_fwd_kernel, module.rms_norm_bwd_kernel]
    assert neuronx.grids == [(2,), (2,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_swiglu_registry_function_on_the_twins(on_the_twins, dtype):
    # The registry's function end to end: block layout, the three kernels, autograd through the gathers.
    neuronx, load = on_the_twins
    module = load("grouped_swiglu")
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([70, 0, 200, 9])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows, experts, dim, hidden = int(counts.sum()), len(counts), 256, 512
    x = (torch.randn(rows, dim, generator=g) * 0.5).to(dtype).requires_grad_()
    w1, w3 = (
        (torch.randn(experts, hidden, dim, generator=g) * 0.05).to(dtype).requires_grad_() for _ in range(2)
    )
    w2 = (torch.randn(experts, dim, hidden, generator=g) * 0.05).to(dtype).requires_grad_()
    inputs = (x, w1, w3, w2)
    assert module.fits(x, w1)
    got = module.grouped_swiglu(*inputs, offsets)
    want = OPS.grouped_swiglu(*inputs, offsets)[0]
    grad = torch.randn_like(want)
    results = (got, *_grads(got, inputs, grad)), (want, *_grads(want, inputs, grad))
    if dtype == torch.float32:  # GEMMs accumulated in another order: at the derived bound
        bounds = grouped_swiglu_bounds(*inputs, offsets, grad)
        for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), *results, strict=True):
            n_terms, abs_sum, carried = bounds[name]
            assert_close_reduction(a, b, n_terms, abs_sum, atol=carried, name=name)
    else:
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    kernels = [
        module.grouped_swiglu_fwd_kernel,
        module.grouped_swiglu_bwd_kernel,
        module.grouped_swiglu_wgrad_kernel,
    ]
    assert neuronx.wrapped == kernels
    assert neuronx.grids == [(2,)] * 3


def test_grouped_swiglu_fits_follows_the_sbuf_arithmetic(on_the_twins):
    _, load = on_the_twins
    module = load("grouped_swiglu")
    x = torch.empty(8, 2048, dtype=torch.bfloat16)
    assert module.fits(x, torch.empty(4, 768, 2048, dtype=torch.bfloat16))  # 30B-A3B's experts
    assert module.fits(x, torch.empty(4, 2048, 2048, dtype=torch.bfloat16))  # Fp 1024: the bf16 limit
    assert not module.fits(x, torch.empty(4, 2304, 2048, dtype=torch.bfloat16))
    assert not module.fits(x.float(), torch.empty(4, 1280, 2048))  # Fp 640 > 512 in fp32
    assert not module.fits(x, torch.empty(4, 640, 2048, dtype=torch.bfloat16))  # not a multiple of 256
