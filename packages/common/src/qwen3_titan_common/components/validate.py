"""Validation while training: torchtitan's validator on held-out rows, every N steps and at the end.

torchtitan's ``Validator`` does the work: it builds its dataloader at each validation, runs the model
without gradients in eval mode (through pipeline stages where there are some), sums the loss over the
valid tokens of every data-parallel rank and divides by their global count, then hands the result to
the metrics processor (``Qwen3Metrics.log_validation``: the line and TensorBoard). This subclass adds:

- its dataloader is ``data.validation.ValidationDataLoader``: held-out rows that are the same on any
  number of ranks, one pass, every batch full (padding rows carry no labels);
- it validates at the run's last step too, not only at step 1 and every ``freq`` steps; the schedule is
  by step number, so a resumed run validates at the same steps as an uninterrupted one;
- it leaves the random generators as it found them: building its data iterator draws a seed from the
  global generator, and the training steps after a validation would otherwise draw other dropout masks
  than a run without it, or than a run resumed from the checkpoint saved just before it;
- bad values (``--validator.freq 0``) are one-line errors instead of assertions.

:func:`data_for_validation` resolves where the data comes from once the training data is known.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Annotated

import torch
import torch.nn as nn
import tyro
from torchtitan.components.validate import Validator
from torchtitan.tools.logging import logger

from qwen3_titan_common.components.preference import PreferenceLoss, take_preference_batch
from qwen3_titan_common.data.validation import ValidationDataLoader, choose_validation_data
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.models.attention import document_attention_of, uses_document_blocks
from qwen3_titan_common.models.context_parallel import split_for_context_parallel
from qwen3_titan_common.perf.progress import Phase
from qwen3_titan_common.runtime.quiet import titan_log_level_at_least


class ValidationConfigError(UserInputError):
    pass


class Qwen3Validator(Validator):
    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        dataloader: ValidationDataLoader.Config = field(default_factory=ValidationDataLoader.Config)
        """Where the validation rows come from (default: the training data's validation split or held-out part)."""

        last_step: Annotated[int, tyro.conf.Suppress] = 0
        """The run's last step, validated too (set from --training.steps)."""

        def __post_init__(self) -> None:
            # Replaces the parent's assertion (a traceback) with the project's one-line errors.
            if self.freq < 1:
                raise ValidationConfigError(
                    f"--validator.freq {self.freq}: expected a positive number of steps"
                )
            if not (self.steps > 0 or self.steps == -1):
                raise ValidationConfigError(
                    f"--validator.steps {self.steps}: expected a positive number of batches, or -1 for all of "
                    "the validation data"
                )

    def __init__(self, config: Config, **kwargs):
        # torchtitan warns that `steps -1` may hang when ranks hold different amounts of data; the rows of
        # ValidationDataLoader give every rank the same number of batches, so the warning would mislead.
        with titan_log_level_at_least(logging.ERROR):
            Validator.__init__(self, config, **kwargs)
        self.reference = None
        """Preference training: the held-out pairs' reference log-probabilities (``train.preference``)."""

    def batches(self):
        """The batches one validation reads (the loader torchtitan's ``validate`` builds, cut at
        ``--validator.steps``): what the reference pass of preference training computes beforehand."""
        pipelined = self.parallel_dims.pp_enabled
        microbatch = self.parallelism.pipeline_parallel_microbatch_size
        loader = self.dl_config.build(
            dp_world_size=self.dp_world_size,
            dp_rank=self.dp_rank,
            tokenizer=self.tokenizer,
            seq_len=self.seq_len,
            local_batch_size=microbatch if pipelined else self.local_batch_size,
        )
        steps = self.config.steps * (self.local_batch_size // microbatch if pipelined else 1)
        return loader, (loader if self.config.steps == -1 else itertools.islice(loader, steps))

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        # A large model's validation takes minutes: past 5 s, a line every 5 s (perf.progress).
        pairs = self.loss_fn.held_out(self.reference) if isinstance(self.loss_fn, PreferenceLoss) else None
        with (
            Phase(f"validation at step {step}"),
            torch.random.fork_rng(devices=_cuda_devices_in_use(), device_type="cuda"),
            pairs or contextlib.nullcontext(),
        ):
            Validator.validate(self, model_parts, step)

    def should_validate(self, step: int) -> bool:
        return Validator.should_validate(self, step) or step == self.config.last_step

    def post_dataloading_process(self, input_dict, labels, model_parts):
        """torchtitan's, except under context parallelism with our per-document attention (as the trainer's);
        a row of preference pairs' targets and records go to the loss, not to the model."""
        pairs = take_preference_batch(input_dict) if isinstance(self.loss_fn, PreferenceLoss) else None
        model_config = getattr(model_parts[0], "config", None)
        if not (self.parallel_dims.cp_enabled and uses_document_blocks(model_config)):
            inputs, labels, extra = Validator.post_dataloading_process(self, input_dict, labels, model_parts)
        else:
            inputs, labels, extra = split_for_context_parallel(
                input_dict,
                labels,
                attention=document_attention_of(model_config),
                group=self.parallel_dims.get_mesh("cp").get_group(),
            )
        if pairs is not None and self.pp_has_last_stage is not False:  # None without pipeline parallelism
            self.loss_fn.expect(labels, pairs)
        return inputs, labels, extra


def _cuda_devices_in_use() -> list[int]:
    """The CUDA device whose generator training draws from (none on CPU): forking every visible GPU's
    generator would initialise them all."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def data_for_validation(validator, dataloader, *, parallelism, training):
    """The validator and training data sections with the validator's data resolved against the training data
    (and the training data's held-out share made explicit where validation reads it), logged in one line; both
    as they are when validation is off or uses another validator."""
    if not validator.enable or not isinstance(validator, Qwen3Validator.Config):
        return validator, dataloader
    train_data, val_data, source = choose_validation_data(dataloader, validator.dataloader)
    if parallelism.pipeline_parallel_degree > 1:
        microbatches = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
        val_data = dataclasses.replace(val_data, microbatches=max(1, microbatches))
    steps = training.steps
    batches = "all of it" if validator.steps == -1 else f"at most {validator.steps} batches"
    logger.info(
        f"[validation] {source}: {batches} at step 1, every {validator.freq} steps and at step {steps} "
        "(--validator.*)"
    )
    return dataclasses.replace(validator, dataloader=val_data, last_step=steps), train_data
