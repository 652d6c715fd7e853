"""The reference ops' fp32 results as reductions, for ``qwen3_titan_common.train.tolerance``.

Each function maps a result's name to ``(n_terms, abs_sum, carried)``, the arguments of
``assert_close_reduction(actual, expected, n_terms, abs_sum, atol=carried)``: the last reduction's
length (or chain of lengths), its sum |terms| per entry, and the bound of the errors its terms carry
in from earlier, separate reductions (each bounded by the same rule, propagated to first order; their
roundings are independent, so they add in quadrature: ``sqrt(errors^2 @ weights^2)``). All computed
from the inputs, in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from qwen3_titan_common.train.tolerance import reduction_atol
from qwen3_titan_nki_moe.ops.grouped_swiglu import grouped_mm, grouped_mm_weight_grad


def rms_norm_bounds(x, weight, grad, eps):
    """y, dx, dw. rstd = rsqrt(mean(x^2) + eps), a D-term sum, scales every term (dx's: up to three times)."""
    x, w, g = (t.detach().double() for t in (x, weight.reshape(-1), grad))
    dim = x.shape[-1]
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_hat, gw = x * rstd, g * w
    abs_dx = rstd * (gw.abs() + x_hat.abs() * (gw * x_hat).abs().mean(-1, keepdim=True))
    abs_dw = (g * x_hat).abs().reshape(-1, dim).sum(0)
    # 5 elementwise roundings: the mean's 1/D and + eps, rsqrt, * rstd, * weight (dw: * grad); dx one more.
    return {
        "y": ((dim, 5), (x_hat * w).abs(), 0.0),
        "dx": ((dim, dim, dim, dim, 6), abs_dx, 0.0),
        "dw": ((x.numel() // dim, dim, 5), abs_dw, 0.0),
    }


def grouped_swiglu_bounds(x, w1, w3, w2, offsets, grad):
    """y, dx, dw1, dw3, dw2 of ``grouped_swiglu`` and its backward, experts' rows split by ``offsets``.

    ``gate``, ``up`` and ``dh`` are D-term contractions; ``h``, ``dgate``, ``dup`` carry their errors
    (through silu, |silu'| <= 1.1, |silu''| <= 0.5) into the F-term (y, dx) or per-expert row sums
    (weight gradients). Elementwise roundings (a few u of a term) are inside the last sum's bound.
    """
    x, w1, w3, w2, dy = (t.detach().double() for t in (x, w1, w3, w2, grad))
    hidden = w1.shape[1]
    # A weight gradient's term meets one rounding per row at most, and one per kernel block of 128.
    rows = x.shape[0] + -(-x.shape[0] // 128)

    def mm(a, b):
        return grouped_mm(a, b, offsets)

    def wmm(a, b):
        return grouped_mm_weight_grad(a, b, offsets)

    gate, up, dh = mm(x, w1.mT), mm(x, w3.mT), mm(dy, w2)
    e_gate = reduction_atol(x.shape[1], mm(x.abs(), w1.abs().mT))
    e_up = reduction_atol(x.shape[1], mm(x.abs(), w3.abs().mT))
    e_dh = reduction_atol(x.shape[1], mm(dy.abs(), w2.abs()))
    sig = torch.sigmoid(gate)
    silu, d_silu = F.silu(gate), sig * (1 + gate * (1 - sig))
    dd_silu = sig * (1 - sig) * (2 + gate * (1 - 2 * sig))
    h, dgate, dup = silu * up, dh * up * d_silu, dh * silu
    e_h = torch.hypot(d_silu * up * e_gate, silu * e_up)
    e_dgate = torch.hypot(torch.hypot(up * d_silu * e_dh, dh * d_silu * e_up), dh * up * dd_silu * e_gate)
    e_dup = torch.hypot(silu * e_dh, dh * d_silu * e_gate)
    # dx: dgate and dup of one entry share dh's and gate's roundings, (a + b)^2 <= 2 (a^2 + b^2).
    carried_dx = (2 * (mm(e_dgate.pow(2), w1.pow(2)) + mm(e_dup.pow(2), w3.pow(2)))).sqrt()
    return {
        "y": (hidden, mm(h.abs(), w2.abs().mT), mm(e_h.pow(2), w2.pow(2).mT).sqrt()),
        "dx": (2 * hidden, mm(dgate.abs(), w1.abs()) + mm(dup.abs(), w3.abs()), carried_dx),
        "dw1": (rows, wmm(dgate.abs(), x.abs()), wmm(e_dgate.pow(2), x.pow(2)).sqrt()),
        "dw3": (rows, wmm(dup.abs(), x.abs()), wmm(e_dup.pow(2), x.pow(2)).sqrt()),
        "dw2": (rows, wmm(dy.abs(), h.abs()), wmm(dy.pow(2), e_h.pow(2)).sqrt()),
    }
