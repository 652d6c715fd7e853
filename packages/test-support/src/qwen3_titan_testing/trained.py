"""The model a ``train`` run trained, read back from one of its step checkpoints in this process.

Built as the run's ranks build it (the config function and flags through torchtitan's
``ConfigManager``, the architecture of ``--hf.model_dir``, ``--lora.*`` through ``LoRASetup``, the
config's ``@override`` factories), on the CPU in fp32 and unsharded, then filled from the step
checkpoint with torch's DCP reader: what tests compare exports against.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from qwen3_titan_common.arch.architecture import read_architecture
from qwen3_titan_common.hf.start import absolute
from qwen3_titan_common.train.lora import LoRASetup
from torchtitan.config import ConfigManager, apply_overrides


def load_trained_model(args: list[str], step_dir: Path, *, with_config: bool = False):
    """The model (and, ``with_config``, the run's resolved ``Trainer.Config`` with it).

    ``args``: ``--module M --config C`` and the run's flags; ``step_dir``: ``<dump>/checkpoint/step-N``.
    """
    config = ConfigManager().parse_args(list(args))
    arch = config.architecture
    if config.hf.model_dir:
        arch = read_architecture(absolute(config.hf.model_dir))
    config = dataclasses.replace(
        config, architecture=arch, model_spec=config.model_spec_builder(arch, config.model_spec.flavor)
    )
    lora = LoRASetup.resolve(
        config.lora,
        parallelism=config.parallelism,
        architecture=arch,
        model_dir=config.hf.model_dir,
        resuming=False,
    )
    if lora is not None:
        config = dataclasses.replace(config, model_spec=lora.model_spec(config.model_spec), lora=lora.options)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    if config.override.imports:
        apply_overrides(config.override, config)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    model.init_states()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(step_dir))
    model.load_state_dict(state)
    return (model.eval(), config) if with_config else model.eval()
