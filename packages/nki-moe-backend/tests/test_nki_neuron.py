"""The NKI kernels through torch-neuronx against their reference ops, on a Trainium host only.

Skipped elsewhere (the NKI modules are not even imported): run them on a trn2 host with
``python tools/run_neuron_tests.py``. The same kernels run on CPU in ``test_nki_kernels_cpu.py``
(the NKI twin here, ``nki.simulate`` with ``--simulate``). Tolerances: bf16 ones are one or two
bf16 ulps (the kernels round where the reference rounds, but accumulate in fp32 PSUM in their own
order); fp32 ones (1e-4) cover the Scalar Engine's polynomial silu/silu' and the fp32 TensorE
reductions; rms_norm's rsqrt runs on GpSimd, the engine the NKI docs name the more precise one, and
its fp32 sums (the weight gradient's over 512 rows) get their derived bound on top
(``qwen3_titan_common.train.tolerance``).
"""

import pytest
import torch
from qwen3_titan_common.runtime.device import neuron_available
from qwen3_titan_common.train.tolerance import assert_close_reduction
from reduction_bounds import rms_norm_bounds

pytestmark = [
    pytest.mark.neuron,
    pytest.mark.skipif(
        not neuron_available(),
        reason="needs a Trainium (Neuron) device: torch_neuronx (Neuron repository build) not importable or no NeuronCore visible",
    ),
]

DEVICE = "neuron"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


def _close(a, b, dtype):
    torch.testing.assert_close(a.cpu().float(), b.cpu().float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_rope_hf_kernel(dtype, head_dim):
    from qwen3_titan_nki_moe.nki import rope_hf as nki_rope

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 512, head_dim, generator=g).to(dtype)
    k = torch.randn(2, 2, 512, head_dim, generator=g).to(dtype)
    angle = torch.randn(1, 512, head_dim // 2, generator=g).repeat(1, 1, 2)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    ref = torch.ops.qwen3_titan.rope_hf(q, k, cos, sin)
    dev = [
        t.to(DEVICE).requires_grad_(t.is_floating_point() and i < 2) for i, t in enumerate((q, k, cos, sin))
    ]
    got = nki_rope.rope_hf_op(*dev)
    for a, b in zip(got, ref, strict=True):
        _close(a, b, dtype)
    grads = [torch.randn_like(t) for t in ref]
    want = torch.ops.qwen3_titan.rope_hf_backward(*grads, cos, sin)
    have = torch.autograd.grad(got, dev[:2], [g_.to(DEVICE) for g_ in grads])
    for a, b in zip(have, want, strict=True):
        _close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_kernel(dtype):
    from qwen3_titan_nki_moe.nki import rms_norm as nki_norm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 256, 1024, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(1024, generator=g)).to(dtype)
    grad = torch.randn_like(x)
    ref = torch.ops.qwen3_titan.rms_norm(x, w, 1e-6)
    want = torch.ops.qwen3_titan.rms_norm_backward(grad, x, w, 1e-6)
    xd, wd = x.to(DEVICE).requires_grad_(), w.to(DEVICE).requires_grad_()
    got = nki_norm.rms_norm_op(xd, wd, 1e-6)
    results = (got, *torch.autograd.grad(got, (xd, wd), grad.to(DEVICE))), (ref, *want)
    if dtype == torch.float32:  # the device's rsqrt allowance plus the sums' derived bound (dw: 512 rows)
        bounds = rms_norm_bounds(x, w, grad, 1e-6)
        for name, a, b in zip(("y", "dx", "dw"), *results, strict=True):
            n_terms, abs_sum, carried = bounds[name]
            assert_close_reduction(a, b, n_terms, abs_sum, atol=carried + 1e-4, rtol=1e-4, name=name)
    else:
        for a, b in zip(*results, strict=True):
            _close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_grouped_swiglu_kernel(dtype):
    from qwen3_titan_nki_moe.nki import grouped_swiglu as nki_moe

    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([300, 0, 129, 64, 1, 530])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows, experts, dim, hidden = int(counts.sum()), len(counts), 256, 512
    x = (torch.randn(rows, dim, generator=g) * 0.5).to(dtype)
    w1, w3 = ((torch.randn(experts, hidden, dim, generator=g) * 0.05).to(dtype) for _ in range(2))
    w2 = (torch.randn(experts, dim, hidden, generator=g) * 0.05).to(dtype)
    grad = torch.randn(rows, dim, generator=g).to(dtype)
    inputs = (x, w1, w3, w2)
    ref, gate, up = torch.ops.qwen3_titan.grouped_swiglu(*inputs, offsets)
    want = torch.ops.qwen3_titan.grouped_swiglu_backward(grad, None, None, *inputs, offsets, gate, up)
    dev = [t.to(DEVICE).requires_grad_() for t in inputs]
    got = nki_moe.grouped_swiglu(*dev, offsets.to(DEVICE))
    _close(got, ref, dtype)
    for a, b in zip(torch.autograd.grad(got, dev, grad.to(DEVICE)), want, strict=True):
        _close(a, b, dtype)


def test_registry_picks_nki_on_trainium(monkeypatch):
    from qwen3_titan_nki_moe import registry

    monkeypatch.delenv("QWEN3_TITAN_DEVICE", raising=False)
    chosen = registry.choose_all("nki")
    assert {c.implementation for c in chosen.values()} == {"nki"}
    from qwen3_titan_nki_moe.overrides import RegistryRMSNorm

    norm = RegistryRMSNorm.Config(normalized_shape=256, kernels="nki").build()
    assert norm.kernel == chosen["rms_norm"]
