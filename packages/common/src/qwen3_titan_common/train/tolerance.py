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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.hf.model_dir import open_model_dir

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


def qwen3_forward_lengths(architecture: Qwen3Architecture, seq_len: int) -> list[int]:
    """The reductions one token's logits pass through in a Qwen3 (or Qwen3-MoE) forward, per the rule's chains.

    Per layer: two RMSNorms and the q/k norms (mean squares), the q/k/v projections, q.k, the softmax's
    sum and its weighted sum of values over ``seq_len`` positions, the output projection, then the MLP
    (gate and up, down) or the MoE's router, its experts' MLPs and the top-k weighted sum; then the final
    norm and the output projection.
    """
    hidden, head_dim, heads = (
        architecture.hidden_size,
        architecture.head_dim,
        architecture.num_attention_heads,
    )
    attention = [hidden, hidden, head_dim, head_dim, hidden, hidden, hidden, head_dim, seq_len, seq_len]
    attention.append(heads * head_dim)
    moe = architecture.moe
    if moe is not None:
        top_k = moe.num_experts_per_tok
        mlp = [hidden, top_k, hidden, hidden, moe.moe_intermediate_size, top_k]
    else:
        mlp = [hidden, hidden, architecture.intermediate_size]
    return architecture.num_hidden_layers * (attention + mlp) + [hidden, hidden]


_LOGIT_WEIGHTS = ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight")


@dataclass(frozen=True)
class ModelBounds:
    """The rule's bounds on a whole Qwen3's logits and loss, computed by two implementations of one model
    (or two reduction orders, two parallel layouts).

    ``logit_scale`` bounds sum |terms| of any logit, |h| |w_j| (Cauchy-Schwarz): the final RMSNorm's output
    has a root mean square of 1 times its weight, so |h| <= sqrt(hidden) max|weight|, and |w_j| is the
    longest row of the output projection (the embedding when tied). Every earlier stage's input is
    RMS-normalised to the same scale, so it stands for theirs too.
    """

    architecture: Qwen3Architecture
    logit_scale: float

    @classmethod
    def from_dir(cls, path) -> ModelBounds:
        """From a Hugging Face checkpoint folder: its config.json and the tensors its index names."""
        from safetensors import safe_open

        model_dir = open_model_dir(path)
        weights = {}
        for key in _LOGIT_WEIGHTS:
            if key in model_dir.tensors:
                with safe_open(str(model_dir.tensors[key].file), framework="pt") as file:
                    weights[key] = file.get_tensor(key)
        return cls.from_state_dict(model_dir.architecture, weights)

    @classmethod
    def from_state_dict(cls, architecture: Qwen3Architecture, state_dict: Mapping) -> ModelBounds:
        """From a model's architecture and its Hugging Face state dict."""
        found = {key: state_dict[key].detach().float() for key in _LOGIT_WEIGHTS if key in state_dict}
        norm = found["model.norm.weight"]
        output = found.get("lm_head.weight", found["model.embed_tokens.weight"])
        scale = math.sqrt(norm.numel()) * norm.abs().max().item() * output.norm(dim=1).max().item()
        return cls(architecture, scale)

    def logit_atol(self, *, seq_len: int, passes: int = 1, dtype=torch.float32):
        """The bound on one logit. ``passes``: the forward chains behind the compared values, as for
        :meth:`loss_atol`."""
        return reduction_atol(
            passes * qwen3_forward_lengths(self.architecture, seq_len), self.logit_scale, dtype
        )

    def log_ratio_atol(self, *, tokens: int, seq_len: int, passes: int = 1, dtype=torch.float32) -> float:
        """The bound on a preference pair's ``h`` (``components.preference``) between two computations of it:
        each of its at most ``tokens`` completion tokens' log-probability, for the policy and the reference,
        moves by twice a logit's bound (the log-sum-exp by at most the largest logit's error), independent
        roundings adding in quadrature (the module's rule). ``passes`` as for :meth:`loss_atol`."""
        return math.sqrt(2 * tokens) * 2 * self.logit_atol(seq_len=seq_len, passes=passes, dtype=dtype)

    def loss_atol(
        self, loss: float, *, tokens: int, seq_len: int, passes: int = 1, dtype=torch.float32
    ) -> float:
        """The bound on a mean cross-entropy over ``tokens`` tokens.

        Three parts add: the mean over ``tokens`` losses (each >= 0: their sum |terms| / tokens is
        ``loss``), the log-sum-exp over the vocabulary (a relative error of the sum of exponentials, at
        most 1 in each's scale, is an absolute one of its log) and the logits (a logit's error moves a
        token's loss by at most twice it: the target's and the softmax-weighted others'). ``passes``:
        forward chains behind the compared values: 1 for one model's loss; 2k - 1 for a training run's
        step-k loss (each optimizer step adds the backward's chains to the weights, to first order the
        forward's again, Adam's update no more sensitive to its gradient's relative error than the
        gradient).
        """
        return (
            reduction_atol(tokens, loss, dtype)
            + reduction_atol(self.architecture.vocab_size, 1.0, dtype)
            + 2 * self.logit_atol(seq_len=seq_len, passes=passes, dtype=dtype)
        )
