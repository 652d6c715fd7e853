"""``Qwen3Trainer`` plus this backend's own flags, the ``hf_v5`` section:

    --hf_v5.attention {sdpa,flex}   sdpa (default) on every device; flex on CUDA only
    --hf_v5.untie_embeddings        train separate embedding and lm_head from a tied model

Everything else (HF directories in and out, data, optimizer, checkpoints) is
``Qwen3Trainer``'s, so the flags are the native backend's plus these two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from qwen3_titan_common.train.trainer import Qwen3Trainer


@dataclass(kw_only=True, slots=True)
class HFv5Options:
    attention: Literal["sdpa", "flex"] = "sdpa"
    """Attention kernel: sdpa (Neuron, CUDA, CPU) or flex (CUDA only)."""

    untie_embeddings: bool = False
    """Train lm_head apart from the embedding even if config.json ties them (export keeps lm_head)."""


class HFv5Trainer(Qwen3Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3Trainer.Config):
        hf_v5: HFv5Options = field(default_factory=HFv5Options)

    @classmethod
    def cuda_graph_blocker(cls, config: Config) -> str | None:
        if config.hf_v5.attention == "flex":
            return "--hf_v5.attention flex: transformers builds the flex block mask on the host at every step"
        return None
