"""The registry's custom ops: opcheck, float64 gradcheck, agreement between their code paths."""

import pytest
import torch
from qwen3_titan_common.train.tolerance import assert_close_reduction
from qwen3_titan_nki_moe import blockwise
from qwen3_titan_nki_moe.ops import grouped_swiglu as grouped_swiglu_ops
from reduction_bounds import grouped_swiglu_bounds
from torch.library import opcheck

OPS = torch.ops.qwen3_titan
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def experts(dtype, counts=(10, 0, 17, 13), dim=16, hidden=32, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    num = len(counts)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)

    def t(*shape):
        return (torch.randn(*shape, generator=g) * 0.5).to(dtype).requires_grad_(requires_grad)

    return t(sum(counts), dim), t(num, hidden, dim), t(num, hidden, dim), t(num, dim, hidden), offsets


def rope_inputs(dtype, batch=2, seq=8, heads=4, kv_heads=2, head_dim=16, requires_grad=True):
    g = torch.Generator().manual_seed(1)
    # [B, N, S, H] views of token-major tensors, as the RoPE override passes them.
    q = torch.randn(batch, seq, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    angle = torch.randn(1, seq, head_dim // 2, generator=g).repeat(1, 1, 2)
    return (
        q.requires_grad_(requires_grad),
        k.requires_grad_(requires_grad),
        angle.cos().to(dtype),
        angle.sin().to(dtype),
    )


def norm_inputs(dtype, requires_grad=True):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 16, generator=g).to(dtype).requires_grad_(requires_grad)
    w = (1 + 0.1 * torch.randn(16, generator=g)).to(dtype).requires_grad_(requires_grad)
    return x, w, 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_forward_ops(dtype):
    opcheck(OPS.grouped_swiglu, experts(dtype))
    opcheck(OPS.rope_hf, rope_inputs(dtype))
    opcheck(OPS.rms_norm, norm_inputs(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_backward_ops(dtype):
    x, w1, w3, w2, offsets = experts(dtype, requires_grad=False)
    _, gate, up = OPS.grouped_swiglu(x, w1, w3, w2, offsets)
    for grad_gate, grad_up in ((None, None), (torch.randn_like(gate), None), (None, torch.randn_like(up))):
        opcheck(
            OPS.grouped_swiglu_backward,
            (torch.randn_like(x), grad_gate, grad_up, x, w1, w3, w2, offsets, gate, up),
        )
    q, k, cos, sin = rope_inputs(dtype, requires_grad=False)
    opcheck(OPS.rope_hf_backward, (torch.randn_like(q), torch.randn_like(k), cos, sin))
    x, w, eps = norm_inputs(dtype, requires_grad=False)
    opcheck(OPS.rms_norm_backward, (torch.randn_like(x), x, w, eps))


def test_opcheck_grouped_swiglu_per_expert_loop(monkeypatch):
    monkeypatch.setattr(grouped_swiglu_ops, "_CPU_GROUPED_MM_DTYPES", ())
    opcheck(OPS.grouped_swiglu, experts(torch.float32))


def test_gradcheck_float64_references():
    # Small shapes: gradcheck perturbs every input element.
    x, w1, w3, w2, offsets = experts(torch.float64, counts=(3, 0, 4, 2), dim=4, hidden=6)
    # Every output: the saved gate and up activations are differentiable too.
    assert torch.autograd.gradcheck(lambda *a: OPS.grouped_swiglu(*a, offsets), (x, w1, w3, w2))
    q, k, cos, sin = rope_inputs(torch.float64, batch=1, seq=4, heads=2, kv_heads=1, head_dim=8)
    assert torch.autograd.gradcheck(lambda a, b: OPS.rope_hf(a, b, cos, sin), (q, k))
    x, w, eps = norm_inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: OPS.rms_norm(a, b, eps), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_mm_and_per_expert_loop_agree(dtype, monkeypatch):
    x, w1, w3, w2, offsets = experts(dtype, counts=(33, 0, 64, 7, 24), dim=32, hidden=64)
    grad = torch.randn_like(x)

    def run():
        out = OPS.grouped_swiglu(x, w1, w3, w2, offsets)[0]
        return (out, *torch.autograd.grad(out, (x, w1, w3, w2), grad))

    grouped = run()
    monkeypatch.setattr(grouped_swiglu_ops, "_CPU_GROUPED_MM_DTYPES", ())
    looped = run()
    # Same sums; the CPU's padded groups run kernels of other shapes, which may add in another order.
    bounds = grouped_swiglu_bounds(x, w1, w3, w2, offsets, grad)
    for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), grouped, looped, strict=True):
        n_terms, abs_sum, carried = bounds[name]
        assert_close_reduction(a, b, n_terms, abs_sum, atol=carried, name=name)


def test_grouped_swiglu_matches_autograd_of_the_stock_formula():
    # torchtitan's GroupedExperts math (three separate grouped GEMMs), differentiated by autograd.
    # Ours has a hand-written backward: equal up to fp32 summation order.
    import torch.nn.functional as F

    x, w1, w3, w2, offsets = experts(torch.float32, counts=(40, 3, 0, 21), dim=32, hidden=48)
    gate = F.grouped_mm(x, w1.mT, offs=offsets)
    up = F.grouped_mm(x, w3.mT, offs=offsets)
    ref = F.grouped_mm(F.silu(gate) * up, w2.mT, offs=offsets)
    out = OPS.grouped_swiglu(x, w1, w3, w2, offsets)[0]
    grad = torch.randn_like(out)
    bounds = grouped_swiglu_bounds(x, w1, w3, w2, offsets, grad)
    for name, a, b in zip(
        ("y", "dx", "dw1", "dw3", "dw2"),
        (out, *torch.autograd.grad(out, (x, w1, w3, w2), grad)),
        (ref, *torch.autograd.grad(ref, (x, w1, w3, w2), grad)),
        strict=True,
    ):
        n_terms, abs_sum, carried = bounds[name]
        assert_close_reduction(a, b, n_terms, abs_sum, atol=carried, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rope_hf_equals_transformers_apply_rotary_pos_emb(dtype):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    q, k, cos, sin = rope_inputs(
        dtype, batch=2, seq=64, heads=8, kv_heads=4, head_dim=128, requires_grad=False
    )
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = OPS.rope_hf(q, k, cos, sin)
    assert got_q.dtype == dtype
    assert (got_q - want_q).abs().max().item() == 0.0
    assert (got_k - want_k).abs().max().item() == 0.0


def test_grouped_mm_plan_names_the_path():
    assert grouped_swiglu_ops.grouped_mm_plan("cpu", torch.bfloat16) == (
        True,
        "F.grouped_mm (cpu, bfloat16)",
    )
    use, why = grouped_swiglu_ops.grouped_mm_plan("cpu", torch.float64)
    assert not use and why.startswith("per-expert loop")


def test_block_layout_of_the_docstring_example():
    layout = blockwise.block_layout(torch.tensor([3, 3, 8], dtype=torch.int32), 8, block=4)
    assert layout.num_blocks == 5
    assert layout.block_expert_N.tolist() == [0, 2, 2, 2, 2]
    assert layout.row_of_slot.tolist() == [0, 1, 2, 8, 3, 4, 5, 6, 7] + [8] * 11
    assert layout.slot_of_row_R.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]
    assert layout.padded_offsets_E.tolist() == [4, 4, 12]
    assert layout.block_start_E1.view(-1).tolist() == [0, 1, 1, 5]


def test_blockwise_computation_equals_the_op():
    # The layout the NKI kernel runs on, checked on CPU against the reference, values and grads.
    x, w1, w3, w2, offsets = experts(torch.float64, counts=(100, 0, 7, 128, 65), dim=32, hidden=48)
    a = blockwise.blockwise_swiglu(x, w1, w3, w2, offsets)
    b = OPS.grouped_swiglu(x, w1, w3, w2, offsets)[0]
    grad = torch.randn_like(a)
    torch.testing.assert_close(a, b)
    for ga, gb in zip(
        torch.autograd.grad(a, (x, w1, w3, w2), grad),
        torch.autograd.grad(b, (x, w1, w3, w2), grad),
        strict=True,
    ):
        torch.testing.assert_close(ga, gb)


def test_cpu_groups_are_padded_to_a_few_shapes_with_the_same_rows():
    # Group sizes change every step; oneDNN keeps a primitive per shape it sees, so the CPU path runs each group
    # at a multiple of CPU_GROUP_ROWS rows: the padded offsets are multiples, every row lands in its own group.
    multiple = grouped_swiglu_ops.CPU_GROUP_ROWS
    counts = torch.tensor([33, 0, 64, 7, 130])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    dest, padded_offsets, padded_rows = grouped_swiglu_ops.cpu_group_layout(offsets)
    sizes = torch.diff(padded_offsets, prepend=padded_offsets.new_zeros(1))
    assert sizes.tolist() == [-(-int(c) // multiple) * multiple for c in counts]
    assert padded_rows == int(padded_offsets[-1])
    expert_of_row = torch.repeat_interleave(torch.arange(5), counts)
    assert torch.all(
        (dest >= (padded_offsets - sizes)[expert_of_row]) & (dest < padded_offsets[expert_of_row])
    )
    assert dest.unique().numel() == dest.numel() == int(counts.sum())
    # The same products; rows past the last offset (no expert's) come out zero.
    a, b = torch.randn(240, 16), torch.randn(5, 16, 8)
    out = grouped_swiglu_ops.grouped_mm(a, b, offsets)
    assert torch.equal(out[234:], torch.zeros(6, 8))
    starts = [0, *offsets[:-1].tolist()]
    groups = list(zip(starts, offsets.tolist(), strict=True))
    looped = torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(groups)])
    abs_sum = torch.cat([a[s:e].abs() @ b[i].abs() for i, (s, e) in enumerate(groups)])
    assert_close_reduction(out[:234], looped, 16, abs_sum, name="grouped rows")
