"""The overridden model computes what torchtitan's model computes, on the same weights and tokens.

The baseline is the backend's model spec without overrides: torchtitan's Qwen3-MoE modules
(CosSinRoPE, RMSNorm, and common's ``ActivationDtypeGroupedExperts``, torchtitan's
``GroupedExperts`` math in the activations' dtype). fp32: logits and every gradient within
1e-5. bf16: printed (rope_hf computes in bf16 where CosSinRoPE upcasts to fp32).
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from nki_moe_models import SMALL_MOE, build, model_configs
from torchtitan.models.common.moe import GroupedExperts

# torchtitan's router asks CPU autocast for fp32, which CPU autocast does not do: harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")


TOL = 1e-5


def _tokens(batch=2, seq=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL_MOE["vocab_size"], (batch, seq + 1), generator=g)


def _run(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), grads


def _max_diffs(a, b):
    logits = (a[0].float() - b[0].float()).abs().max().item()
    grads = {name: (a[1][name].float() - b[1][name].float()).abs().max().item() for name in a[1]}
    return logits, grads


def _pair(dtype):
    stock_cfg, overridden_cfg, _ = model_configs()
    stock = build(stock_cfg).to(dtype)
    overridden = build(overridden_cfg, seed=1, state_dict=stock.state_dict()).to(dtype)
    return stock, overridden


def test_fp32_logits_and_gradients_match_torchtitan():
    stock, overridden = _pair(torch.float32)
    tokens = _tokens()
    logits_diff, grad_diffs = _max_diffs(_run(stock, tokens), _run(overridden, tokens))
    worst = max(grad_diffs, key=grad_diffs.get)
    print(f"\nfp32: logits max abs diff {logits_diff:.3g}; worst gradient {worst}: {grad_diffs[worst]:.3g}")
    assert logits_diff <= TOL
    assert len(grad_diffs) == len(dict(stock.named_parameters()))
    assert all(d <= TOL for d in grad_diffs.values()), {k: v for k, v in grad_diffs.items() if v > TOL}


def test_bf16_difference_is_reported():
    stock, overridden = _pair(torch.bfloat16)
    tokens = _tokens()
    a, b = _run(stock, tokens), _run(overridden, tokens)
    logits_diff, grad_diffs = _max_diffs(a, b)
    scale = a[0].float().abs().max().item()
    worst = max(grad_diffs, key=grad_diffs.get)
    print(
        f"\nbf16: logits max abs diff {logits_diff:.3g} (logits up to {scale:.3g}); "
        f"worst gradient {worst}: {grad_diffs[worst]:.3g}"
    )
    assert logits_diff < 0.05 * scale


def test_fp32_against_torchtitans_bf16_grouped_experts_is_reported():
    # torchtitan's own GroupedExperts computes the experts in bf16 even in an fp32 model.
    stock_cfg, overridden_cfg, _ = model_configs()
    for layer in stock_cfg.layers:
        inner = layer.moe.routed_experts.inner_experts
        layer.moe.routed_experts.inner_experts = GroupedExperts.Config(
            **{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)}
        )
    stock = build(stock_cfg)
    overridden = build(overridden_cfg, seed=1, state_dict=stock.state_dict())
    tokens = _tokens()
    logits_diff, _ = _max_diffs(_run(stock, tokens), _run(overridden, tokens))
    print(f"\nfp32 vs torchtitan's bf16-only GroupedExperts: logits max abs diff {logits_diff:.3g}")
    assert logits_diff < 0.05
