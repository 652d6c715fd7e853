"""torchtitan's Trainer plus Hugging Face checkpoints in and out.

``Qwen3Trainer.Config`` adds an ``hf`` section to ``Trainer.Config``:

    --hf.model_dir DIR          start from this HF directory (config.json + safetensors)
    --hf.no-export              do not write an HF directory at the end
    --hf.export_dir DIR         where exports go (default <dump_folder>/hf), as step-N/
    --hf.export_interval N      also export every N steps (0: only at the end)
    --hf.export_dtype D         auto (the loaded checkpoint's dtype, else float32),
                                float32, bfloat16 or float16
    --hf.max_shard_size S       e.g. 5GB (default), 500MB

a ``lora`` section (``--lora.rank R`` ...: LoRA fine-tuning with peft adapters, ``train.lora``), a
``moe`` section (``--moe.router_aux_loss on`` ...: Qwen3-MoE's router balance loss, ``components.router_balance``),
and ``--objective dpo`` with its ``dpo`` section (preference training, ``components.preference``).

Every backend's config functions return this Config (or a backend's subclass), so the flags are the
same for all of them; a backend supplies ``model_spec_builder`` to rebuild its model from a
checkpoint's architecture. The trainer itself only decides where the weights come from (``hf.start``)
and when to export; the checkpoint manager (``components.checkpoint``) checks the disk and writes exports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

import torch.distributed as dist
import tyro
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.observability import structured_logger as sl
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.components.loss import TrainedTokenLoss
from qwen3_titan_common.components.preference import (
    Objective,
    PreferenceLoss,
    PreferenceOptions,
    take_preference_batch,
)
from qwen3_titan_common.components.router_balance import LMLossWithRouterBalance, MoEOptions
from qwen3_titan_common.errors import UserInputError, first_line
from qwen3_titan_common.hf.export import parse_size
from qwen3_titan_common.hf.start import StartPoint, newest_complete_step
from qwen3_titan_common.models.attention import document_attention_of, uses_document_blocks
from qwen3_titan_common.models.context_parallel import split_for_context_parallel
from qwen3_titan_common.perf.optimizer_state import describe_trainable
from qwen3_titan_common.perf.precision import model_compute_dtype
from qwen3_titan_common.perf.progress import Phase
from qwen3_titan_common.perf.progress import set_cadence as set_progress_cadence
from qwen3_titan_common.protocols.rank_errors import rank_errors
from qwen3_titan_common.protocols.summary import (
    LauncherOptions,
    RunRecord,
    converted_summary,
    report,
    summary_of,
)
from qwen3_titan_common.train.lora import LoRAOptions
from qwen3_titan_common.train.outputs import OutputDefaults
from qwen3_titan_common.train.rehearsal import Rehearsal
from qwen3_titan_common.train.resolve import resolve_run_config
from qwen3_titan_common.train.run_card import run_card

ModelSpecBuilder = Callable[[Qwen3Architecture, str], ModelSpec]


@dataclass(kw_only=True, slots=True)
class HFCheckpointConfig:
    model_dir: str | None = None
    """Hugging Face model directory to start from (its config.json shapes the model)."""

    export: bool = True
    """Write a Hugging Face directory at the end of training."""

    export_dir: str | None = None
    """Where exports go, as step-N/ (default: <dump_folder>/hf)."""

    export_interval: int = 0
    """Also export every N steps (0: only at the end)."""

    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Tensor dtype on disk; auto = the loaded checkpoint's, float32 without one."""

    to_dcp: bool = False
    """Convert, do not train: load --hf.model_dir (on this run's layout) and write its weights as the torchtitan
    checkpoint step-0 in the checkpoint folder, then stop. A run on that folder starts from it; another run
    takes it with --checkpoint.initial_load_path DIR/step-0."""

    max_shard_size: str = "5GB"
    """Largest safetensors shard, e.g. 5GB, 500MB. Not transformers 5's 50GB: an export holds one shard in host
    memory (docs/checkpoints.md); 50GB gives save_pretrained's layout."""

    download_hint: Annotated[str | None, tyro.conf.Suppress] = None
    """Command that fetches model_dir, quoted when the directory is missing."""

    def __post_init__(self) -> None:
        if self.export_interval < 0:
            raise UserInputError(
                f"--hf.export_interval {self.export_interval}: expected 0 (only at the end) or more"
            )
        parse_size(self.max_shard_size)


@dataclass(kw_only=True, slots=True)
class Qwen3DebugConfig(DebugConfig):
    layers: int | None = None
    """Train only the first N decoder layers, from random weights at the model's width (a check of the
    layout's numerics, not of the model: train --check-layout runs 2)."""


class Qwen3Trainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        debug: Qwen3DebugConfig = field(default_factory=Qwen3DebugConfig)
        hf: HFCheckpointConfig = field(default_factory=HFCheckpointConfig)
        lora: LoRAOptions = field(default_factory=LoRAOptions)
        moe: MoEOptions = field(default_factory=MoEOptions)
        objective: Objective = "sft"
        """sft: next-token loss on the trained tokens; dpo: preference pairs (--dpo.*, docs/preference.md)."""
        dpo: PreferenceOptions = field(default_factory=PreferenceOptions)
        launcher: LauncherOptions = field(default_factory=LauncherOptions)
        rehearsal: Rehearsal.Config = field(default_factory=Rehearsal.Config)
        architecture: Annotated[Qwen3Architecture | None, tyro.conf.Suppress] = None
        model_spec_builder: Annotated[ModelSpecBuilder | None, tyro.conf.Suppress] = None
        output_defaults: Annotated[OutputDefaults | None, tyro.conf.Suppress] = None
        config_function: Annotated[tuple[str, str] | None, tyro.conf.Suppress] = None
        """``(--module, --config)`` of the function that built this config, set by it (errors, model cards)."""

        def __post_init__(self) -> None:
            # torchtitan refuses CUDA graphs with pipeline or expert parallelism when it parses the config,
            # on any device, and asks for --training.disable_cuda_graphs. Where there is no CUDA device, or the
            # layout cannot be captured, the run is eager without that flag (resolve_cuda_graphs says why on CUDA).
            if not self.training.disable_cuda_graphs and (
                titan_utils.device_type != "cuda" or _layout_graph_blocker(self) is not None
            ):
                self.training = dataclasses.replace(self.training, disable_cuda_graphs=True)
            Trainer.Config.__post_init__(self)

        def build(self, **kwargs):
            """The trainer; or, when the launcher rehearses the job (``--rehearsal.mode``), rank 0's rehearsal
            (``train.rehearsal``), which torchtitan's entry runs as it runs a trainer."""
            if self.rehearsal.mode:
                return self.rehearsal.build(trainer_config=self, trainer=self._owner)
            return Trainer.Config.build(self, **kwargs)

    def __init__(self, config: Config):
        from qwen3_titan_common.runtime.quiet import quiet_what_does_not_apply
        from qwen3_titan_common.train.dump_lock import hold_in_rank

        quiet_what_does_not_apply(titan_utils.device_type, int(os.environ.get("WORLD_SIZE", "1")))
        with rank_errors(lambda: config):
            self._start, config = self.resolved_and_checked(config)
            set_progress_cadence(getattr(config.metrics, "progress_seconds", 5.0))
            self._dump_lock = hold_in_rank(config.dump_folder)
            self.run_record = RunRecord.of_rank(
                config.launcher, config.dump_folder, str(Path(config.dump_folder) / config.checkpoint.folder)
            )
            self.run_record.save()
            config = self.resolve_cuda_graphs(config)
            super().__init__(config)
            self._initialise_alike_in_every_layout(config)
        self.metrics_processor.run_record = self.run_record
        if isinstance(self.loss_fn, LMLossWithRouterBalance):
            # As torchtitan hands a chunked loss its lm_head: the routers it reads, the ranks it averages over.
            self.loss_fn.bind(
                self.model_parts,
                group=self.parallel_dims.get_optional_mesh("batch").get_group()
                if self.parallel_dims.dp_enabled
                else None,
                microbatches=self.gradient_accumulation_steps,
            )
            self.metrics_processor.router_balance = self.loss_fn
        if isinstance(self.loss_fn, TrainedTokenLoss):
            # Its output projection runs outside the model's forward, in the model's compute dtype.
            self.loss_fn.compute_dtype = model_compute_dtype(self.model_parts[0])
        if isinstance(self.loss_fn, PreferenceLoss):
            dims = self.parallel_dims
            self.loss_fn.bind(
                dims.get_mesh("batch").get_group() if dims.dp_enabled else None,
                context=dims.get_mesh("cp").get_group() if dims.cp_enabled else None,
                pipeline=dims.get_mesh("pp").get_group() if dims.pp_enabled else None,
                device=self.device,
            )
            self.metrics_processor.preference = self.loss_fn
        self.live_reference = None
        if isinstance(self.loss_fn, PreferenceLoss) and self.loss_fn.options.reference == "live":
            from qwen3_titan_common.train.preference import LIVE_REFERENCE_STATE, LiveReference

            self.live_reference = LiveReference(self.model_parts)
            # A disabled manager (no step checkpoints, nothing to load) has no states.
            if self.checkpointer.enable:
                self.checkpointer.states[LIVE_REFERENCE_STATE] = self.live_reference
                self.checkpointer.checkpoint_bytes += self.live_reference.nbytes
        # The steps this process trains, for the summary: the step lines show only every --metrics.log_freq-th.
        self.first_trained_step: int | None = None
        self._finished = False  # train() returned: every rank meets the others once more as it closes
        logger.info(describe_trainable(self.model_parts, self.optimizers))

    def _initialise_alike_in_every_layout(self, config: Config) -> None:
        """A run from random weights gets the same ones in every parallel layout (``models.layout_init``)."""
        from qwen3_titan_common.models.layout_init import initialise_whole_then_shard

        seed = config.debug.seed
        if self._start.kind != "random" or config.checkpoint.initial_load_path or seed is None:
            return
        drawn = initialise_whole_then_shard(self.model_parts, seed)
        total = len({id(p) for part in self.model_parts for p in part.parameters()})
        if drawn == total:
            logger.info(
                f"[start] random weights: {drawn} tensors drawn whole from seed {seed}, the same in any layout"
            )
        else:
            logger.info(
                f"[start] random weights: {drawn} of {total} tensors drawn whole from seed {seed}, the same in any "
                "layout; the others as torchtitan draws them, per shard"
            )

    @classmethod
    def resolved_and_checked(
        cls, config: Config, *, deferred: list[str] | None = None
    ) -> tuple[StartPoint, Config]:
        """The run's config resolved in one place (``resolve_run_config``: the architecture of
        ``--hf.model_dir``, model spec, loss vocabulary, export plan, LoRA; then the validation data), and
        every check on it (``train.preflight.check_run``, the backend's :meth:`prepare_backend`), before
        anything is written. Each rank and ``train --dry-run`` run it first; raises a one-line
        UserInputError. ``deferred``: a dry run's list of what only the machines of the job can confirm."""
        from qwen3_titan_common.components.validate import data_for_validation
        from qwen3_titan_common.train.preflight import check_run

        try:
            start, config = resolve_run_config(config)
        except UserInputError:
            raise
        except (ValueError, AssertionError) as err:
            # torchtitan validates the config again once the model directory's architecture is in it.
            which = f"--config {config.config_function[1]}" if config.config_function else "the config"
            raise UserInputError(f"{which} with these flags: {first_line(err)}") from None
        validator, dataloader = data_for_validation(
            config.validator, config.dataloader, parallelism=config.parallelism, training=config.training
        )
        config = dataclasses.replace(config, validator=validator, dataloader=dataloader)
        trainer = cls.for_config(config)
        check_run(config, deferred=deferred, tied=trainer.trains_tied_embeddings(config))
        trainer.prepare_backend(config)
        return start, config

    @classmethod
    def for_config(cls, config: Config) -> type[Qwen3Trainer]:
        """The trainer class (this one or a backend's subclass) whose ``Config`` ``config`` is."""
        stack = [cls]
        while stack:
            trainer = stack.pop()
            if type(config) is trainer.Config:
                return trainer
            stack.extend(trainer.__subclasses__())
        return cls

    @classmethod
    def trains_tied_embeddings(cls, config: Config) -> bool:
        """Whether the model this run trains shares one matrix between its embedding and its output
        projection: the checkpoint's ``tie_word_embeddings``, unless the backend trains the two apart."""
        return config.architecture is not None and config.architecture.tie_word_embeddings

    @classmethod
    def prepare_backend(cls, config: Config) -> None:
        """A backend's own checks and choices on the run's resolved config (``resolve_run_config``), before
        anything is written; each rank and ``train --dry-run`` call it. Raises a one-line UserInputError."""
        cls.check_parallelism(config)

    @classmethod
    def check_parallelism(cls, config: Config) -> None:
        """The parallel layouts this backend does not run, refused in one line (part of :meth:`prepare_backend`).
        A check of the config alone, without effects: the rehearsal also asks it of layouts a job that fits
        nowhere might take."""

    @classmethod
    def cuda_graph_blocker(cls, config: Config) -> str | None:
        """Why this run's forward and backward cannot be captured in a CUDA graph, or None.

        torchtitan captures them by default; a backend whose step syncs with the host (a loop over
        data-dependent sizes, a mask built on the host) names the reason here.
        """
        return None

    @classmethod
    def resolve_cuda_graphs(cls, config: Config) -> Config:
        """The run's config with torchtitan's CUDA graphs off, and one log line, where the layout
        (``Config.__post_init__``) or :meth:`cuda_graph_blocker` names a reason; off without a line on other
        devices (torchtitan would warn that it runs eagerly there); otherwise ``config`` itself."""
        if titan_utils.device_type != "cuda":
            return config  # already off (Config.__post_init__)
        layout = _layout_graph_blocker(config)
        if config.training.disable_cuda_graphs and layout is None:
            return config  # the user's --training.disable_cuda_graphs
        reason = layout or cls.cuda_graph_blocker(config)
        if reason is None and isinstance(config.loss, LMLossWithRouterBalance.Config):
            reason = "the router balance loss reads each forward's routing from the routers (--moe.router_aux_loss)"
        if reason is None and isinstance(config.loss, PreferenceLoss.Config):
            reason = "the preference loss takes each batch's pairs from the data on the host, which a replay would not (--objective dpo)"
        if reason is None:
            return config
        logger.info(f"[cuda graphs] off for this run: {reason}")
        return dataclasses.replace(
            config, training=dataclasses.replace(config.training, disable_cuda_graphs=True)
        )

    def post_dataloading_process(self, input_dict, labels):
        """torchtitan's, except under context parallelism with our per-document attention: this CP rank's share
        of each row and its block pairs against the whole row (``models.context_parallel``). A row of preference
        pairs' targets and records go to the preference loss (with the labels it will be called on), not to
        the model."""
        pairs = take_preference_batch(input_dict) if isinstance(self.loss_fn, PreferenceLoss) else None
        if not (self.parallel_dims.cp_enabled and uses_document_blocks(self.model_config)):
            inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        else:
            inputs, labels, extra = split_for_context_parallel(
                input_dict,
                labels,
                attention=document_attention_of(self.model_config),
                group=self.parallel_dims.get_mesh("cp").get_group(),
            )
            self.ntokens_seen += labels.numel()
        if pairs is not None and (not self.parallel_dims.pp_enabled or self.pp_has_last_stage):
            self.loss_fn.expect(labels, pairs)
        return inputs, labels, extra

    def batch_generator(self, data_iterable):
        """torchtitan's batches, each one's trained tokens (labels not ignored; a preference row's completion
        tokens) counted for the step line."""
        from torchtitan.components.loss import IGNORE_INDEX

        for input_dict, labels in super().batch_generator(data_iterable):
            trained = input_dict.get("dpo_targets", labels)
            self.metrics_processor.trained_tokens_since_last_log += int((trained != IGNORE_INDEX).sum())
            yield input_dict, labels

    def train_step(self, data_iterator) -> None:
        if self.first_trained_step is None:
            self.first_trained_step = self.step
        if isinstance(self.loss_fn, LMLossWithRouterBalance | PreferenceLoss):
            self.loss_fn.start_step()
        if self.live_reference is not None:
            # The step's batches, drawn as torchtitan's step draws them, scored by the reference first.
            draws = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
            batches = [next(data_iterator) for _ in range(draws)]
            # The swap writes the weights and the reference's copy: an asynchronous save must have staged both.
            self.checkpointer.maybe_wait_for_staging()
            self.live_reference.score(self, batches)
            data_iterator = iter(batches)
        super().train_step(data_iterator)
        interval = self.config.hf.export_interval
        if (
            self.config.hf.export
            and interval > 0
            and self.step % interval == 0
            and self.step != self.config.training.steps
        ):
            self.checkpointer.export_hf(self.step, card=run_card(self, self.step))

    def train(self):
        with rank_errors(lambda: self.config):
            if self.config.hf.to_dcp:
                self.checkpointer.load(step=self.config.checkpoint.load_step)
                converted = self.checkpointer.save_weights_as_step_zero()
                if not dist.is_initialized() or dist.get_rank() == 0:
                    report(converted_summary(self, converted), self.run_record, logger.info)
            else:
                try:
                    self._train_steps()
                except KeyboardInterrupt:
                    self._record_newest_checkpoint()
                    raise
                export = None
                if self.config.hf.export:
                    export = self.checkpointer.export_hf(self.step, card=run_card(self, self.step))
                if not dist.is_initialized() or dist.get_rank() == 0:
                    report(summary_of(self, export), self.run_record, logger.info)
            self._finished = True

    def _record_newest_checkpoint(self) -> None:
        """On an interruption, the newest step checkpoint that reads whole, for the launcher's last line (read
        here, where torch is loaded already; the launcher would import it for this alone)."""
        if self.run_record.folder is None:
            return
        newest = newest_complete_step(Path(self.run_record.checkpoint_folder))
        self.run_record.interrupted_with_checkpoint = -1 if newest is None else newest
        self.run_record.save()

    def close(self) -> None:
        super().close()
        if self._finished and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank of a run that finished leaves together, once its own closing is done (an asynchronous
            # save written, the loggers flushed): none tears its process group down, or exits and closes its
            # connections, while another still writes its last checkpoint or export, still closes, or (under
            # --max-restarts) still needs the store that rank 0 hosts. torchtitan's own loop pauses rank 0 for two
            # seconds instead, on every run. A run that failed does not wait here for ranks that may be gone.
            dist.barrier()
        # The process ends after this: torchtitan's entry tears the process group down and returns. Python's
        # collection of the whole heap at exit (torch's, transformers' and inductor's module graphs) then costs
        # about 1.3 s per rank and frees nothing the operating system does not. Frozen, the heap is skipped;
        # every file the run wrote is closed by now (checkpointer, metrics, export, summary).
        gc.freeze()

    def _train_steps(self) -> None:
        """The steps from the checkpoint (if any) to ``--training.steps``: torchtitan's loop, written here as its
        own subclasses (torchft's, forge's) write theirs, calling its components in its order: load, then per
        step train, save, validate, profile, and the shorter collective timeout after this process's first step.

        What differs is the end: torchtitan's rank 0 pauses two seconds "for other ranks to complete" before
        returning; here every rank meets the others at the end of ``train`` instead (after the export and
        the summary), which waits exactly as long as the slowest rank and no longer."""
        config = self.config
        sl.log_trace_instant("training_start")
        self.checkpointer.load(step=config.checkpoint.load_step)
        if isinstance(self.loss_fn, PreferenceLoss):
            from qwen3_titan_common.train.preference import (
                live_reference_ready,
                reference_logps,
                validation_reference_logps,
            )

            if self.live_reference is not None:
                self.loss_fn.reference = live_reference_ready(self)
            else:
                self.loss_fn.reference = reference_logps(self)
            if config.validator.enable:
                self.validator.reference = validation_reference_logps(self)
        started_after = self.step
        logger.info(f"Training starts at step {started_after + 1}")
        with config.profiler.build(global_step=self.step, base_folder=config.dump_folder) as profiler:
            batches = self.batch_generator(self.dataloader)
            while self.should_continue_training():
                self.step += 1
                sl.set_step(self.step, relative_step=self.step - started_after)
                with sl.log_trace_span("step"):
                    self.gc_handler.run(self.step)
                    try:
                        # The first step compiles and warms up (minutes on Trainium): past 5 s, a line every 5 s.
                        first = Phase(f"step {self.step}, the first of this run (compilation, warm-up)")
                        with first if self.step == started_after + 1 else contextlib.nullcontext():
                            self.train_step(batches)
                    except DataloaderExhaustedError:
                        logger.warning("Ran out of data; last step was canceled.")
                        break
                    self.checkpointer.save(self.step, last_step=self.step == config.training.steps)
                    if config.validator.enable and self.validator.should_validate(self.step):
                        self.validator.validate(self.model_parts, self.step)
                    profiler.step()
                    if self.step == started_after + 1:
                        # Lazy initialisation and compilation are behind: later collectives get the shorter timeout.
                        timeout = timedelta(seconds=config.comm.train_timeout_seconds)
                        dist_utils.set_pg_timeouts(timeout=timeout, parallel_dims=self.parallel_dims)
        logger.info("Training completed")


def _layout_graph_blocker(config: Trainer.Config) -> str | None:
    """Why the parallel layout keeps the step out of a CUDA graph (torchtitan's own rule), or None."""
    if config.parallelism.pipeline_parallel_degree > 1:
        return "pipeline parallelism (torchtitan captures no pipeline schedule)"
    if config.parallelism.expert_parallel_degree > 1:
        return "expert parallelism (the token exchange's sizes are read on the host)"
    return None
