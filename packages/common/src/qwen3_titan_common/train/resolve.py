"""A run's config resolved once, before anything is built: where its weights come from, and each component's
section from the sections it reads.

``Qwen3Trainer.resolved_and_checked`` calls :func:`resolve_run_config` on every rank and in the launcher's
rehearsal. In order:

1. the outputs' folder (named after ``--hf.model_dir`` unless ``--dump_folder`` names one) and
   ``--debug.layers``' cut of the model;
2. the start point (``hf.start``: resume a step checkpoint, load ``--hf.model_dir``, or random weights), said
   in one line with the precision;
3. the architecture it implies (the directory's ``config.json``, also on a resume), the model spec rebuilt from
   it, the checkpoint section that loads the directory, and the run's model record checked against a resumed
   checkpoint's;
4. each component's section, in the order their refusals fire: the router balance loss (loss, and the model
   recording its routing), preference training (loss and data), the trained-token loss (loss), the expert
   exchange (model), context parallelism over our attention (parallelism), LoRA (model, checkpoint, lora).

Each component's resolve takes its own section and reads others by name, returning its section: none takes
or returns the whole config.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger

from qwen3_titan_common.arch.architecture import Qwen3Architecture, read_architecture
from qwen3_titan_common.components.checkpoint import HFExportPlan
from qwen3_titan_common.components.loss import loss_on_trained_tokens
from qwen3_titan_common.components.model_record import (
    check_data_position,
    check_model_record,
    model_record,
    schedule_changes,
    schedule_of,
)
from qwen3_titan_common.components.preference import loss_and_data_for_preference
from qwen3_titan_common.components.router_balance import (
    LMLossWithRouterBalance,
    loss_with_router_balance,
    model_recording_routing,
    model_with_expert_exchange,
)
from qwen3_titan_common.data.loader import POSITION_FORMAT, TextChatDataLoader
from qwen3_titan_common.errors import CheckpointError, UserInputError
from qwen3_titan_common.hf.export import EXPORT_DTYPES, parse_size
from qwen3_titan_common.hf.model_dir import GENERATION_CONFIG
from qwen3_titan_common.hf.start import StartPoint, absolute, plan_start
from qwen3_titan_common.models.attention import parallelism_for_document_cp
from qwen3_titan_common.perf.precision import precision_line
from qwen3_titan_common.train.lora import LoRASetup
from qwen3_titan_common.train.outputs import run_dump_folder


def resolve_run_config(config):
    """Where the run's weights come from (logged in one line), and the config that trains them (``config`` is a
    ``Qwen3Trainer.Config``, or a backend's subclass; see the module docstring for the order).

    With ``--hf.model_dir`` the model is the directory's (its config.json's architecture, its tokenizer, its
    weights loaded before step 1), so the returned config is rebuilt from it; the checkpoint manager gets the
    export plan either way.
    """
    if config.architecture is None or config.model_spec_builder is None:
        raise CheckpointError(
            "Qwen3Trainer.Config needs `architecture` and `model_spec_builder` (set by config functions)"
        )
    config = _with_dump_folder(config)
    cut = None
    if config.debug.layers is not None:
        config, cut = _first_layers(config, config.debug.layers)
    start = plan_start(
        model_dir=config.hf.model_dir,
        checkpoint_folder=Path(config.dump_folder) / config.checkpoint.folder,
        checkpoint_enabled=config.checkpoint.enable,
        download_hint=config.hf.download_hint,
    )
    logger.info(f"[start] {start.message}")
    logger.info(
        f"[precision] {precision_line(config.training.mixed_precision_param, titan_utils.device_type)}"
    )
    config = _with_start(config, start, cut or config.architecture)
    where = (
        f"{start.model_dir.path}/config.json" if start.model_dir is not None else "the model's config.json"
    )
    return start, _with_components(config, start, where)


def _with_dump_folder(config):
    dump_folder = run_dump_folder(config.dump_folder, config.hf.model_dir, config.output_defaults)
    if dump_folder == config.dump_folder:
        return config
    logger.info(
        f"[start] outputs go to {dump_folder}: named after --hf.model_dir (--dump_folder picks another)"
    )
    return dataclasses.replace(config, dump_folder=dump_folder)


def _first_layers(config, layers: int) -> tuple:
    """``--debug.layers N``: the run's config without ``--hf.model_dir`` (its tokenizer kept, its weights not
    loaded) and the architecture (the directory's, else the config's) cut to its first N decoder layers."""
    model_dir = config.hf.model_dir
    architecture = read_architecture(absolute(model_dir)) if model_dir else config.architecture
    if not 1 <= layers <= architecture.num_hidden_layers:
        raise UserInputError(
            f"--debug.layers {layers}: expected 1 to the model's {architecture.num_hidden_layers} decoder layers"
        )
    if model_dir:
        changes: dict = {"hf": dataclasses.replace(config.hf, model_dir=None)}
        folder = Path(absolute(model_dir))
        if any((folder / name).is_file() for name in ("tokenizer.json", "vocab.json")):
            changes["hf_assets_path"] = str(folder)
        config = dataclasses.replace(config, **changes)
    logger.info(
        f"[start] --debug.layers {layers}: the first {layers} of {architecture.num_hidden_layers} decoder layers, "
        "from random weights"
    )
    return config, architecture.with_changes(num_hidden_layers=layers)


def _with_start(config, start: StartPoint, architecture: Qwen3Architecture):
    """The config of the model ``start`` implies: its architecture, the model spec and loss vocabulary rebuilt
    from it, its tokenizer, the checkpoint section that loads ``--hf.model_dir``, the export plan and the model
    record (checked against a resumed checkpoint's)."""
    if config.hf.model_dir and start.kind == "resume":
        # The architecture still comes from the directory the run started from.
        try:
            architecture = read_architecture(absolute(config.hf.model_dir))
        except CheckpointError:
            pass
    model_dir = start.model_dir
    checkpoint = config.checkpoint
    if model_dir is None and start.kind != "resume" and checkpoint.initial_load_path:
        # Our default for initial_load_model_only is not torchtitan's (components.checkpoint): say which applies.
        what = "the weights" if checkpoint.initial_load_model_only else "the whole training state"
        logger.info(f"[start] --checkpoint.initial_load_path {checkpoint.initial_load_path}: loading {what}")
    changes: dict = {}
    if model_dir is not None:
        architecture = model_dir.architecture
        if model_dir.has_tokenizer:
            changes["hf_assets_path"] = str(model_dir.path)
        else:
            logger.info(f"[start] {model_dir.path} has no tokenizer files: using {config.hf_assets_path}")
        checkpoint = dataclasses.replace(
            checkpoint,
            enable=True,
            save_steps=checkpoint.enable,
            initial_load_path=str(model_dir.path),
            initial_load_in_hf=True,
            initial_load_model_only=True,
        )
    if architecture is not config.architecture:
        changes["architecture"] = architecture
        changes["model_spec"] = config.model_spec_builder(architecture, config.model_spec.flavor)
        if getattr(config.loss, "global_vocab_size", None) is not None:
            # torchtitan's vocabulary-parallel cross-entropy splits the logits by this size.
            changes["loss"] = dataclasses.replace(config.loss, global_vocab_size=architecture.vocab_size)
    record = _model_record(config, architecture)
    if start.kind == "resume":
        _check_resume(config, start, record)
    plan = HFExportPlan(
        base_dir=Path(config.hf.export_dir or Path(config.dump_folder) / "hf"),
        architecture=architecture,
        dtype=_export_dtype(config.hf.export_dtype, start),
        max_shard_bytes=parse_size(config.hf.max_shard_size),
        assets_dir=Path(changes.get("hf_assets_path", config.hf_assets_path)),
        generation_config=model_dir.path / GENERATION_CONFIG
        if model_dir is not None and model_dir.has_generation_config
        else None,
    )
    changes["checkpoint"] = dataclasses.replace(checkpoint, hf_export=plan, model_record=record)
    return dataclasses.replace(config, **changes)


def _model_record(config, architecture: Qwen3Architecture):
    """What a step checkpoint of this run records of its model and schedule (``components.model_record``)."""
    position = POSITION_FORMAT if isinstance(config.dataloader, TextChatDataLoader.Config) else None
    return model_record(
        config.model_spec.name,
        architecture,
        schedule_of(config, int(os.environ.get("WORLD_SIZE", "1"))),
        position,
        lora=config.lora,
        live_reference=config.objective == "dpo" and config.dpo.reference == "live",
    )


def _check_resume(config, start: StartPoint, record) -> None:
    """A resumed checkpoint of this model and data, not past the last step asked for; other settings said."""
    checkpoint_folder = Path(config.dump_folder) / config.checkpoint.folder
    check_model_record(checkpoint_folder, record, step=start.resume_step, dump_folder=config.dump_folder)
    check_data_position(checkpoint_folder, record, step=start.resume_step)
    if config.training.steps < start.resume_step:
        raise UserInputError(
            f"--training.steps {config.training.steps} (--steps): the newest checkpoint in {checkpoint_folder} "
            f"is at step {start.resume_step}, past the last step asked for; pass --steps above "
            f"{start.resume_step} to train on, or a new --dump_folder to start over"
        )
    changed = schedule_changes(checkpoint_folder, record)
    if changed:
        logger.info(
            f"[start] resuming step {start.resume_step} with other settings than it was trained with "
            f"({'; '.join(changed)}): this run's apply from step {start.resume_step + 1}"
        )


def _export_dtype(name: str, start: StartPoint) -> torch.dtype:
    if name == "auto":
        name = start.model_dir.dtype_name if start.model_dir is not None else "float32"
    return EXPORT_DTYPES.get(name, torch.float32)  # float64 weights export as float32


def _with_components(config, start: StartPoint, where: str):
    """Each component's section resolved from the sections it reads, in the order their refusals fire."""
    device_type = titan_utils.device_type
    architecture, parallelism = config.architecture, config.parallelism
    model = config.model_spec.model
    loss = loss_with_router_balance(
        config.loss, config.moe, architecture=architecture, parallelism=parallelism, where=where
    )
    if isinstance(loss, LMLossWithRouterBalance.Config):
        model = model_recording_routing(model)
    loss, dataloader = loss_and_data_for_preference(
        loss,
        config.dataloader,
        config.dpo,
        objective=config.objective,
        moe=config.moe,
        parallelism=parallelism,
        model_config=model,
        device_type=device_type,
    )
    loss = loss_on_trained_tokens(
        loss, parallelism=parallelism, seq_len=config.training.seq_len, device_type=device_type
    )
    model = model_with_expert_exchange(
        model, config.moe, architecture=architecture, parallelism=parallelism, device_type=device_type
    )
    parallelism = parallelism_for_document_cp(
        parallelism, model_config=model, seq_len=config.training.seq_len
    )
    spec = config.model_spec
    if model is not spec.model:
        spec = dataclasses.replace(spec, model=model)
    checkpoint, options = config.checkpoint, config.lora
    lora = LoRASetup.resolve(
        config.lora,
        parallelism=parallelism,
        architecture=architecture,
        model_dir=config.hf.model_dir,
        resuming=start.kind == "resume",
    )
    if lora is not None:
        spec, checkpoint, options = lora.model_spec(spec), lora.checkpoint(checkpoint), lora.options
    return dataclasses.replace(
        config,
        loss=loss,
        dataloader=dataloader,
        model_spec=spec,
        parallelism=parallelism,
        checkpoint=checkpoint,
        lora=options,
    )
