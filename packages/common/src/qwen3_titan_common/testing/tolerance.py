"""Tolerances of floating-point reductions, derived from their length: one rule for every test.

Two computations of one sum (a dot product, a matmul's contraction, a mean, a weight gradient summed
over rows) that add in different orders (a kernel's tiles, torch's thread-count-dependent splits)
differ by their rounding errors only. A rounding scales a partial result by (1 + d), |d| <= u = eps/2,
and no partial result exceeds A = sum |terms|, whatever the order: one side is off by at most
(n - 1) * u * A (Higham, *Accuracy and Stability of Numerical Algorithms*, 4.2), the worst case, all
roundings one way. As independent errors of mean zero (Higham & Mary, SIAM J. Sci. Comput. 41 (2019)
A2815: round to nearest on the tests' random inputs) they add up like a random walk: one side is off
by at most LAMBDA * sqrt(n) * u * A but with probability 2n * exp(-LAMBDA^2 / 2). The rule, both sides:

    |actual - expected| <= LAMBDA * sqrt(n) * eps(dtype) * A,    LAMBDA = 10

It cannot flake (an entry fails by rounding with odds under 1e-17 at n = 1e4, whatever the order,
thread count or machine) and still catches bugs: it allows 10 * sqrt(n) * eps of A (3e-5 of A at
n = 640 in fp32); a dropped tile, a slipped index or a wrong normalisation moves a result by far more.
Give A per entry where it is cheap (``(a.abs() * b.abs()).sum(dim)``, a matmul of absolute values),
else a scalar bound of it (``n * max|term|``). Chains: a factor computed by another reduction that
scales every term (RMSNorm's rstd) adds its length to a sequence, each length its own sqrt(n)
(conservative: sqrt(a) + sqrt(b) >= sqrt(a + b)); a factor entering k times is listed k times,
elementwise roundings count one each. Terms that carry errors of earlier, separate reductions (a matmul
of a matmul's output): bound those by this rule, propagate them to the result to first order (in
quadrature where their roundings are independent) and pass the result as ``atol``. ``dtype`` is the one
the sum accumulates in (``torch.finfo``): bf16 and fp16 follow the same rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

LAMBDA = 10.0


def reduction_atol(n_terms: int | Sequence[int], abs_sum, dtype: torch.dtype = torch.float32):
    """The rule's bound on |actual - expected|: LAMBDA * sum(sqrt(n)) * eps(dtype) * abs_sum.

    ``n_terms``: the reduction's length, or the lengths of a chain; ``abs_sum``: sum |terms| of each
    entry (a tensor broadcasting to the result) or a scalar bound of it.
    """
    lengths = [n_terms] if isinstance(n_terms, int) else list(n_terms)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"n_terms={n_terms!r}: expected reduction lengths >= 1")
    return LAMBDA * sum(math.sqrt(n) for n in lengths) * torch.finfo(dtype).eps * abs_sum


def assert_close_reduction(
    actual, expected, n_terms, abs_sum, *, dtype=torch.float32, atol=0.0, rtol=0.0, name="result"
):
    """Assert ``|actual - expected| <= reduction_atol(n_terms, abs_sum, dtype) + atol + rtol * |expected|``.

    ``atol`` (a scalar or per entry) and ``rtol`` add allowances: errors the terms carry in (see the
    module docstring) or a device's approximate functions.
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{name}: {actual.dtype}{list(actual.shape)} vs {expected.dtype}{list(expected.shape)}"
    )
    a, e = (t.detach().cpu().double() for t in (actual, expected))
    scale = torch.as_tensor(abs_sum.detach().cpu() if torch.is_tensor(abs_sum) else abs_sum).double()
    diff = (a - e).abs()
    bound = (reduction_atol(n_terms, scale, dtype) + atol + rtol * e.abs()).broadcast_to(diff.shape)
    over = ~(diff <= bound)  # NaN counts as over
    if over.any():
        worst = int((diff - bound).nan_to_num(nan=math.inf).argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        raise AssertionError(
            f"{name}: {int(over.sum())} of {diff.numel()} entries beyond the bound of a {n_terms}-term "
            f"{dtype} reduction (LAMBDA {LAMBDA:g}); worst at {at}: |{a[at]:.9g} - {e[at]:.9g}| = "
            f"{diff[at]:.3g} > {bound[at]:.3g}"
        )
