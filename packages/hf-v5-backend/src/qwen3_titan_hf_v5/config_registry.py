"""Config functions of the hf-v5 backend: ``--module qwen3_titan_hf_v5 --config NAME``.

Every function takes no arguments and returns a ``Trainer.Config`` built by common's
``build_trainer_config`` (data, optimizer, schedule, checkpoints and HF export identical to
the native backend's, with the same run shapes, so losses compare); torchtitan's CLI flags
are applied on top (``--training.steps 5``), plus ``--hf_v5.attention`` and
``--hf_v5.untie_embeddings``.
"""

from __future__ import annotations

from pathlib import Path

# Helpers are imported under private names: torchtitan lists every public callable
# of this module as a config function in its "not found" error.
from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.arch.published import published_architecture as _published_architecture
from qwen3_titan_common.assets import debug_moe_architecture as _debug_moe_architecture
from qwen3_titan_common.assets import default_architecture as _default_architecture
from qwen3_titan_common.assets import default_tokenizer_dir as _default_tokenizer_dir
from qwen3_titan_common.train.config import RunShape
from qwen3_titan_common.train.config import build_trainer_config as _build_trainer_config
from qwen3_titan_common.train.config import debug_shape as _debug_shape
from qwen3_titan_common.train.config import qwen3_4b_2507_checkpoint as _qwen3_4b_2507_checkpoint
from qwen3_titan_common.train.config import real_size_shape as _real_size_shape
from qwen3_titan_common.train.trainer import HFCheckpointConfig

from qwen3_titan_hf_v5.model_spec import hf_v5_model_spec as _hf_v5_model_spec
from qwen3_titan_hf_v5.trainer import HFv5Trainer

BACKEND = "hf-v5"


def _config(
    arch: Qwen3Architecture, flavor: str, shape: RunShape, assets: Path, hf: HFCheckpointConfig | None = None
) -> HFv5Trainer.Config:
    return _build_trainer_config(
        arch, flavor, _hf_v5_model_spec, assets_path=assets, shape=shape, hf=hf, trainer=HFv5Trainer
    )


def debug() -> HFv5Trainer.Config:
    """The embedded tiny Qwen3 (about 4M parameters) as a transformers model, on the embedded corpus."""
    return _config(_default_architecture(), "debug", _debug_shape(BACKEND, "debug"), _default_tokenizer_dir())


def debug_moe() -> HFv5Trainer.Config:
    """The embedded tiny Qwen3-MoE (8 experts, top-2, 2 layers) as transformers' Qwen3MoeForCausalLM."""
    return _config(
        _debug_moe_architecture(), "debug_moe", _debug_shape(BACKEND, "debug_moe"), _default_tokenizer_dir()
    )


def _published(name: str, hub_name: str) -> HFv5Trainer.Config:
    return _config(
        _published_architecture(hub_name), name, _real_size_shape(BACKEND, name), _default_tokenizer_dir()
    )


def qwen3_0_6b() -> HFv5Trainer.Config:
    """Qwen3-0.6B shape, random init (give a model directory to start from its weights)."""
    return _published("qwen3_0_6b", "Qwen3-0.6B")


def qwen3_1_7b() -> HFv5Trainer.Config:
    """Qwen3-1.7B shape, random init."""
    return _published("qwen3_1_7b", "Qwen3-1.7B")


def qwen3_4b() -> HFv5Trainer.Config:
    """Qwen3-4B shape (RoPE theta 1e6, as the original release), random init."""
    return _published("qwen3_4b", "Qwen3-4B")


def v5_qwen3_4b() -> HFv5Trainer.Config:
    """The recipe's config: Qwen3-4B-Instruct-2507 (RoPE theta 5e6) from assets/hf/, through transformers v5."""
    name = "v5_qwen3_4b"
    hf = _qwen3_4b_2507_checkpoint()
    arch = _published_architecture("Qwen3-4B-Instruct-2507")
    return _config(arch, name, _real_size_shape(BACKEND, name), _default_tokenizer_dir(), hf)
