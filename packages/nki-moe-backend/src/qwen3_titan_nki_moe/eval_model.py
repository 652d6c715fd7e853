"""``eval --backend nki-moe-backend``: the model spec its trainer builds, kernels chosen as it chooses them.

Its own module: it starts from the backend's config function (``config_registry.debug_moe``), which imports
the trainer.
"""

from __future__ import annotations

from qwen3_titan_common.hf.titan_load import cover_tokens
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
from torchtitan.config.override import apply_overrides

from qwen3_titan_nki_moe.config_registry import debug_moe
from qwen3_titan_nki_moe.trainer import prepare_kernels


def nki_moe_eval_spec(arch, *, seq_len: int, routing_recorded: bool = False):
    """``eval --backend nki-moe-backend``: torchtitan's Qwen3-MoE shaped by ``arch`` with this backend's
    kernels, chosen as the trainer chooses them (``--kernels auto``: NKI on Trainium where the shapes allow, the
    reference kernels elsewhere) and swapped in by the same ``@override`` factories."""
    # The backend's own config (fresh, ours to fill in), with this architecture and sequence length: what
    # its trainer would build. Not dataclasses.replace: that re-runs torchtitan's checks, which print.
    config = debug_moe()
    config.model_spec = titan_qwen3_model_spec(arch, "eval")
    if routing_recorded:
        config.model_spec.model = config.model_spec.model.with_routing_recorded()
    config.training.seq_len = seq_len
    cover_tokens(config.model_spec.model, seq_len)
    prepare_kernels(config)
    apply_overrides(config.override, config)
    return config.model_spec
