"""The tensors a Qwen3 / Qwen3-MoE checkpoint holds on disk, by Hugging Face name.

The HF layout is fixed by the architecture, whatever backend trains the model, so
a checkpoint can be checked against it before any weight is read.
"""

from __future__ import annotations

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.errors import CheckpointError

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def expected_hf_shapes(arch: Qwen3Architecture) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = arch.hidden_size, arch.head_dim
    q_out = arch.num_attention_heads * head_dim
    kv_out = arch.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (arch.vocab_size, hidden)}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q_out, hidden),
                p + "self_attn.k_proj.weight": (kv_out, hidden),
                p + "self_attn.v_proj.weight": (kv_out, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_out),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
            }
        )
        if arch.moe is None:
            ffn = arch.intermediate_size
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (ffn, hidden),
                    p + "mlp.up_proj.weight": (ffn, hidden),
                    p + "mlp.down_proj.weight": (hidden, ffn),
                }
            )
        else:
            ffn = arch.moe.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (arch.moe.num_experts, hidden)
            for e in range(arch.moe.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update(
                    {
                        q + "gate_proj.weight": (ffn, hidden),
                        q + "up_proj.weight": (ffn, hidden),
                        q + "down_proj.weight": (hidden, ffn),
                    }
                )
    shapes["model.norm.weight"] = (hidden,)
    shapes[LM_HEAD] = (arch.vocab_size, hidden)
    return shapes


def _summarise(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def key_problems(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], tied: bool
) -> list[str]:
    """Every missing key, unexpected key and shape mismatch, as ``kind: key ...`` strings."""
    optional = {LM_HEAD} if tied else set()
    missing = sorted(expected.keys() - found.keys() - optional)
    unexpected = sorted(found.keys() - expected.keys())
    mismatched = sorted(
        f"{key} (expected {list(expected[key])}, found {list(found[key])})"
        for key in expected.keys() & found.keys()
        if tuple(expected[key]) != tuple(found[key])
    )
    problems = []
    if missing:
        problems.append(f"missing {len(missing)}: {_summarise(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)}: {_summarise(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch {len(mismatched)}: {_summarise(mismatched)}")
    return problems


def check_keys(
    where: str, expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], tied: bool
) -> None:
    problems = key_problems(expected, found, tied)
    if problems:
        raise CheckpointError(f"{where}: checkpoint does not fit the model: " + "; ".join(problems))
