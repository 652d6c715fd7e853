"""Config functions of the native backend: ``--module qwen3_titan_native --config NAME``.

Every function takes no arguments and returns a ``Trainer.Config``; torchtitan's CLI
flags are applied on top (``--training.steps 5``).
"""

from __future__ import annotations

from pathlib import Path

# Helpers are imported under private names: torchtitan lists every public callable
# of this module as a config function in its "not found" error.
from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.arch.published import published_architecture as _published_architecture
from qwen3_titan_common.assets import default_architecture as _default_architecture
from qwen3_titan_common.assets import default_tokenizer_dir as _default_tokenizer_dir
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec as _titan_qwen3_model_spec
from qwen3_titan_common.train.config import RunShape
from qwen3_titan_common.train.config import build_trainer_config as _build_trainer_config
from qwen3_titan_common.train.config import debug_shape as _debug_shape
from qwen3_titan_common.train.config import qwen3_4b_2507_checkpoint as _qwen3_4b_2507_checkpoint
from qwen3_titan_common.train.config import real_size_shape as _real_size_shape
from qwen3_titan_common.train.trainer import HFCheckpointConfig
from torchtitan.trainer import Trainer

BACKEND = "native"


def _config(
    arch: Qwen3Architecture, flavor: str, shape: RunShape, assets: Path, hf: HFCheckpointConfig | None = None
) -> Trainer.Config:
    return _build_trainer_config(
        arch, flavor, _titan_qwen3_model_spec, assets_path=assets, shape=shape, hf=hf
    )


def debug() -> Trainer.Config:
    """The embedded tiny Qwen3 (about 4M parameters) on the embedded corpus."""
    return _config(_default_architecture(), "debug", _debug_shape(BACKEND, "debug"), _default_tokenizer_dir())


def _published(name: str, hub_name: str) -> Trainer.Config:
    return _config(
        _published_architecture(hub_name), name, _real_size_shape(BACKEND, name), _default_tokenizer_dir()
    )


def qwen3_0_6b() -> Trainer.Config:
    """Qwen3-0.6B shape, random init (give a model directory to start from its weights)."""
    return _published("qwen3_0_6b", "Qwen3-0.6B")


def qwen3_1_7b() -> Trainer.Config:
    """Qwen3-1.7B shape, random init."""
    return _published("qwen3_1_7b", "Qwen3-1.7B")


def qwen3_4b() -> Trainer.Config:
    """Qwen3-4B shape (RoPE theta 1e6, as the original release), random init."""
    return _published("qwen3_4b", "Qwen3-4B")


def qwen3_8b() -> Trainer.Config:
    """Qwen3-8B shape (untied embeddings), random init."""
    return _published("qwen3_8b", "Qwen3-8B")


def native_qwen3_4b() -> Trainer.Config:
    """The recipe's config: Qwen3-4B-Instruct-2507 (RoPE theta 5e6) from assets/hf/."""
    name = "native_qwen3_4b"
    hf = _qwen3_4b_2507_checkpoint()
    arch = _published_architecture("Qwen3-4B-Instruct-2507")
    return _config(arch, name, _real_size_shape(BACKEND, name), _default_tokenizer_dir(), hf)
