"""Training FLOPs per token, from the architecture alone.

    flops/token = 6 * N_matmul + attention

``N_matmul`` counts the weights a token multiplies through: attention q/k/v/o, the
dense MLP, or for MoE the router plus ``num_experts_per_tok`` experts (only active
experts; torchtitan's transformers backend counts all of them), and the output
projection (lm_head). The embedding lookup is not a matmul and is not counted; with
tied embeddings the shared matrix is counted once, as lm_head. Norm weights are
elementwise and negligible; they are left out. The factor 6 = 2 (multiply-add) x 3
(forward, and two matmuls in backward).

The attention term covers the two sequence-length-dependent matmuls (QK^T and PV),
forward and backward: ``12 * layers * heads * head_dim * seq_len`` per token,
torchtitan's convention, which does NOT halve for the causal mask (the work a dense
kernel does). ``causal=True`` halves it (the work a causal-aware kernel needs). Both
are offered; every log line and benchmark says which one it used.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from qwen3_titan_common.arch.architecture import Qwen3Architecture


@dataclass(frozen=True)
class FlopsBreakdown:
    matmul_params: int  # weights touched per token
    total_params: int  # every parameter, all experts, embedding once when tied
    attention_flops: int
    causal_halving: bool

    @property
    def per_token(self) -> int:
        return 6 * self.matmul_params + self.attention_flops


def _attention_weights(arch: Qwen3Architecture) -> int:
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    return arch.hidden_size * (q + 2 * kv) + q * arch.hidden_size


def flops_breakdown(arch: Qwen3Architecture, seq_len: int, causal: bool = False) -> FlopsBreakdown:
    hidden = arch.hidden_size
    attention = _attention_weights(arch)
    norms = 2 * hidden + 2 * arch.head_dim
    if arch.moe is None:
        mlp_active = mlp_total = 3 * hidden * arch.intermediate_size
    else:
        expert = 3 * hidden * arch.moe.moe_intermediate_size
        router = hidden * arch.moe.num_experts
        mlp_active = router + arch.moe.num_experts_per_tok * expert
        mlp_total = router + arch.moe.num_experts * expert
    layers = arch.num_hidden_layers
    head = arch.vocab_size * hidden
    embedding = 0 if arch.tie_word_embeddings else arch.vocab_size * hidden
    attention_flops = 12 * layers * arch.num_attention_heads * arch.head_dim * seq_len
    if causal:
        attention_flops //= 2
    return FlopsBreakdown(
        matmul_params=layers * (attention + mlp_active) + head,
        total_params=layers * (attention + mlp_total + norms) + hidden + head + embedding,
        attention_flops=attention_flops,
        causal_halving=causal,
    )


def flops_per_token(arch: Qwen3Architecture, seq_len: int, causal: bool = False) -> int:
    return flops_breakdown(arch, seq_len, causal).per_token


def describe(breakdown: FlopsBreakdown) -> str:
    """The one log line of a run's convention (benchmarks read it back)."""
    return (
        f"[metrics] {breakdown.per_token / 1e9:.3f} GFLOP per token: 6 x {breakdown.matmul_params:,} "
        f"matmul parameters + {breakdown.attention_flops:,} attention "
        f"({'causal-halved' if breakdown.causal_halving else 'not halved'}); "
        f"{breakdown.total_params:,} parameters in all"
    )


@dataclass(frozen=True)
class FlopsConvention:
    """What a model config needs to count FLOPs per token by this convention, whatever the backend."""

    architecture: Qwen3Architecture
    causal_halving: bool = False

    def with_metrics_config(self, metrics_config) -> FlopsConvention:
        """The convention as the run's metrics ask for it (``--metrics.flops_causal_halving``)."""
        causal = bool(getattr(metrics_config, "flops_causal_halving", False))
        return dataclasses.replace(self, causal_halving=causal)

    def per_token(self, seq_len: int) -> int:
        breakdown = flops_breakdown(self.architecture, seq_len, causal=self.causal_halving)
        logging.getLogger(__name__).info(describe(breakdown))
        return breakdown.per_token
