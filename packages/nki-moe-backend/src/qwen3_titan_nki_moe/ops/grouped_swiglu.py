"""``qwen3_titan::grouped_swiglu``: the routed experts' SwiGLU MLP over expert-sorted token groups.

Rows ``offsets_E[e-1]:offsets_E[e]`` of ``x_RD`` belong to expert ``e`` (the layout torchtitan's
token dispatcher produces); for each group::

    out = (silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T

All inputs share one dtype and the output has it too (the module casts the weights to the
activations' dtype first). The reference runs its grouped GEMMs with ``F.grouped_mm``
where this device and dtype support it and with a per-expert loop elsewhere (see
:func:`grouped_mm_plan`). The op also returns the pre-activation gate and up rows (``[R, F]``
each, fewer bytes than autograd would keep for the same math) so that its backward runs no
GEMM twice; the NKI kernel recomputes them instead (on-chip memory, not FLOPs, is what it is
short of).
:func:`reference` is the registry's function: the op's first output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

NAMESPACE = "qwen3_titan"

# Dtypes F.grouped_mm (torch.nn.functional.grouped_mm) accepts, by device type (checked on
# torch 2.14: CPU runs bf16/fp16/fp32 and rejects fp64; CUDA's kernels need sm90+ and bf16).
_CPU_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CUDA_MIN_CAPABILITY = (9, 0)
# On the CPU each expert's rows are padded with zero rows to a multiple of this. F.grouped_mm's CPU kernel runs
# one oneDNN matmul per group, and oneDNN keeps a compiled primitive per distinct shape (up to 1,024 of them,
# each with its own buffers): group sizes that change every step grew a debug MoE rank by ~27 MiB a step, past
# 1 GiB in 40 steps. Multiples of 64 leave a few dozen shapes (docs/performance.md, "Memory estimate").
CPU_GROUP_ROWS = 64


def grouped_mm_plan(device: torch.device | str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the reference uses ``F.grouped_mm`` here, and why (for the registry's log line)."""
    device = torch.device(device)
    if device.type == "cpu":
        if dtype in _CPU_GROUPED_MM_DTYPES:
            return True, f"F.grouped_mm (cpu, {_short(dtype)})"
        return False, f"per-expert loop (cpu: F.grouped_mm has no {_short(dtype)} kernel)"
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        arch = f"sm{capability[0]}{capability[1]}"
        if capability < _CUDA_MIN_CAPABILITY:
            return False, f"per-expert loop (cuda {arch}: F.grouped_mm needs sm90+)"
        if dtype != torch.bfloat16:
            return (
                False,
                f"per-expert loop (cuda {arch}: F.grouped_mm runs bf16 only, got {_short(dtype)})",
            )
        return True, f"F.grouped_mm (cuda {arch}, bf16)"
    if device.type == "neuron" and dtype == torch.bfloat16:
        # TorchNeuron lists aten::_grouped_mm (what F.grouped_mm calls) as supported; a
        # per-expert loop would compile one graph per group size. Not run here: this is the
        # fallback when NKI cannot run.
        return True, "F.grouped_mm (neuron, bf16)"
    return False, f"per-expert loop ({device.type}, {_short(dtype)}: no F.grouped_mm kernel known)"


def grouped_gemm_summary(device_kind: str) -> str:
    """How the reference runs its grouped GEMMs on this kind of device, for the registry's log line."""
    if device_kind == "cpu":
        return "grouped GEMM: F.grouped_mm for bf16/fp16/fp32, per-expert loop for fp64"
    if device_kind == "cuda" and torch.cuda.is_available():
        use, why = grouped_mm_plan("cuda", torch.bfloat16)
        return f"grouped GEMM: {why}" + (", per-expert loop for other dtypes" if use else "")
    if device_kind == "neuron":
        return "grouped GEMM: F.grouped_mm for bf16, per-expert loop otherwise"
    return "grouped GEMM: per-expert loop"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(t: Tensor) -> bool:
    # F.grouped_mm (CPU and CUDA) rejects strides that are not multiples of 16 bytes, and
    # needs 16-byte aligned data (not guaranteed for memory-mapped checkpoint tensors).
    if t.data_ptr() % 16:
        return False
    return all(stride * t.element_size() % 16 == 0 for stride in t.stride() if stride != 1)


def _use_grouped_mm(*tensors: Tensor) -> bool:
    first = tensors[0]
    use, _ = grouped_mm_plan(first.device, first.dtype)
    return use and all(_aligned(t) for t in tensors)


def _group_bounds(offsets_E: Tensor) -> list[tuple[int, int, int]]:
    bounds, start = [], 0
    for expert, end in enumerate(offsets_E.tolist()):
        bounds.append((expert, start, end))
        start = end
    return bounds


def cpu_group_layout(offsets_E: Tensor) -> tuple[Tensor, Tensor, int]:
    """Where each grouped row goes when every group is padded to :data:`CPU_GROUP_ROWS` rows:
    ``(dest_N, padded_offsets_E, padded_rows)`` for the ``N = offsets_E[-1]`` rows that belong to a group."""
    offsets_E = offsets_E.long()
    counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    padded_E = (counts_E + CPU_GROUP_ROWS - 1) // CPU_GROUP_ROWS * CPU_GROUP_ROWS
    padded_offsets_E = torch.cumsum(padded_E, 0)
    shift_E = (padded_offsets_E - padded_E) - (offsets_E - counts_E)
    rows = int(offsets_E[-1])
    dest_N = torch.arange(rows, device=offsets_E.device) + torch.repeat_interleave(
        shift_E, counts_E, output_size=rows
    )
    return dest_N, padded_offsets_E.to(torch.int32), int(padded_offsets_E[-1])


def _padded(t_RX: Tensor, dest_N: Tensor, padded_rows: int) -> Tensor:
    out_PX = t_RX.new_zeros(padded_rows, t_RX.shape[1])
    out_PX[dest_N] = t_RX[: dest_N.shape[0]]
    return out_PX


def grouped_mm(a_RK: Tensor, b_EKN: Tensor, offsets_E: Tensor) -> Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]``; rows past ``offsets_E[-1]`` are zero."""
    if _use_grouped_mm(a_RK, b_EKN):
        if a_RK.device.type != "cpu":
            return F.grouped_mm(a_RK, b_EKN, offs=offsets_E)
        dest_N, padded_offsets_E, padded_rows = cpu_group_layout(offsets_E)
        out_PN = F.grouped_mm(_padded(a_RK, dest_N, padded_rows), b_EKN, offs=padded_offsets_E)
        out_RN = out_PN.new_zeros(a_RK.shape[0], out_PN.shape[1])
        out_RN[: dest_N.shape[0]] = out_PN[dest_N]
        return out_RN
    out_RN = a_RK.new_zeros(a_RK.shape[0], b_EKN.shape[-1])
    for expert, start, end in _group_bounds(offsets_E):
        if end > start:
            out_RN[start:end] = a_RK[start:end] @ b_EKN[expert]
    return out_RN


def grouped_mm_weight_grad(a_RM: Tensor, b_RN: Tensor, offsets_E: Tensor) -> Tensor:
    """``out[e] = a[rows of e].T @ b[rows of e]`` (the weight gradient of a grouped GEMM)."""
    if _use_grouped_mm(a_RM, b_RN):
        if a_RM.device.type != "cpu":
            return F.grouped_mm(a_RM.transpose(0, 1), b_RN, offs=offsets_E)
        # Zero rows add nothing to a group's sum.
        dest_N, padded_offsets_E, padded_rows = cpu_group_layout(offsets_E)
        a_PM, b_PN = _padded(a_RM, dest_N, padded_rows), _padded(b_RN, dest_N, padded_rows)
        return F.grouped_mm(a_PM.transpose(0, 1), b_PN, offs=padded_offsets_E)
    num_experts = offsets_E.shape[0]
    out_EMN = a_RM.new_zeros(num_experts, a_RM.shape[1], b_RN.shape[1])
    for expert, start, end in _group_bounds(offsets_E):
        if end > start:
            out_EMN[expert] = a_RM[start:end].transpose(0, 1) @ b_RN[start:end]
    return out_EMN


@torch.library.custom_op(f"{NAMESPACE}::grouped_swiglu", mutates_args=())
def grouped_swiglu(
    x_RD: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, w2_EDF: Tensor, offsets_E: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(out_RD, gate_RF, up_RF)``: the pre-activation gate and up rows are kept for the
    backward (like flash attention's logsumexp), so it needs no GEMM recompute."""
    gate_RF = grouped_mm(x_RD, w1_EFD.transpose(-2, -1), offsets_E)
    up_RF = grouped_mm(x_RD, w3_EFD.transpose(-2, -1), offsets_E)
    h_RF = F.silu(gate_RF) * up_RF
    return grouped_mm(h_RF, w2_EDF.transpose(-2, -1), offsets_E), gate_RF, up_RF


@grouped_swiglu.register_fake
def _(x_RD, w1_EFD, w3_EFD, w2_EDF, offsets_E):
    rows, hidden = x_RD.shape[0], w1_EFD.shape[1]
    return x_RD.new_empty(rows, w2_EDF.shape[1]), x_RD.new_empty(rows, hidden), x_RD.new_empty(rows, hidden)


@torch.library.custom_op(f"{NAMESPACE}::grouped_swiglu_backward", mutates_args=())
def grouped_swiglu_backward(
    grad_RD: Tensor,
    grad_gate_RF: Tensor | None,
    grad_up_RF: Tensor | None,
    x_RD: Tensor,
    w1_EFD: Tensor,
    w3_EFD: Tensor,
    w2_EDF: Tensor,
    offsets_E: Tensor,
    gate_RF: Tensor,
    up_RF: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # Gate and up stay separate GEMMs: concatenating them would copy the [E, 2F, D] weight
    # (as large as the GEMM's operands) on every call, more than the wider GEMM saves on CPU.
    silu_RF = F.silu(gate_RF)
    h_RF = silu_RF * up_RF

    dh_RF = grouped_mm(grad_RD, w2_EDF, offsets_E)
    dw2_EDF = grouped_mm_weight_grad(grad_RD, h_RF, offsets_E)
    # aten's own silu derivative, so the reference matches autograd through F.silu.
    dgate_RF = torch.ops.aten.silu_backward(dh_RF * up_RF, gate_RF)
    dup_RF = dh_RF * silu_RF
    if grad_gate_RF is not None:  # only when a caller used the saved activations
        dgate_RF = dgate_RF + grad_gate_RF
    if grad_up_RF is not None:
        dup_RF = dup_RF + grad_up_RF
    dx_RD = grouped_mm(dgate_RF, w1_EFD, offsets_E)
    dx_RD += grouped_mm(dup_RF, w3_EFD, offsets_E)
    dw1_EFD = grouped_mm_weight_grad(dgate_RF, x_RD, offsets_E)
    dw3_EFD = grouped_mm_weight_grad(dup_RF, x_RD, offsets_E)
    return dx_RD, dw1_EFD, dw3_EFD, dw2_EDF


@grouped_swiglu_backward.register_fake
def _(grad_RD, grad_gate_RF, grad_up_RF, x_RD, w1_EFD, w3_EFD, w2_EDF, offsets_E, gate_RF, up_RF):
    return (
        torch.empty_like(x_RD),
        torch.empty_like(w1_EFD),
        torch.empty_like(w3_EFD),
        torch.empty_like(w2_EDF),
    )


def _setup_context(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs, output[1], output[2])


def _backward(ctx, grad_RD, grad_gate_RF, grad_up_RF):
    saved = ctx.saved_tensors  # the op's inputs, then its gate and up outputs
    x_RD, w2_EDF = saved[0], saved[3]
    if grad_RD is None:
        grad_RD = torch.zeros(x_RD.shape[0], w2_EDF.shape[1], dtype=x_RD.dtype, device=x_RD.device)
    dx, dw1, dw3, dw2 = torch.ops.qwen3_titan.grouped_swiglu_backward(
        grad_RD.contiguous(), grad_gate_RF, grad_up_RF, *saved
    )
    return dx, dw1, dw3, dw2, None


grouped_swiglu.register_autograd(_backward, setup_context=_setup_context)


def reference(x_RD: Tensor, w1_EFD: Tensor, w3_EFD: Tensor, w2_EDF: Tensor, offsets_E: Tensor) -> Tensor:
    """The registry's reference implementation: the op's output rows (its activations stay for backward)."""
    return torch.ops.qwen3_titan.grouped_swiglu(x_RD, w1_EFD, w3_EFD, w2_EDF, offsets_E)[0]
