"""The ``--lora.*`` section: LoRA fine-tuning on every backend, and what it changes in a run's config.

    --lora.rank R          adapter rank; 0 (the default) trains every weight (full fine-tuning)
    --lora.alpha A         scaling = alpha / rank (peft's lora_alpha; default 16)
    --lora.dropout P       dropout on each adapter's input (peft's lora_dropout; default 0)
    --lora.targets a,b     Hugging Face projection names (default: q_proj,k_proj,v_proj,o_proj,
                           gate_proj,up_proj,down_proj); in a Qwen3-MoE the MLPs are routed experts,
                           which are not adapted: only the attention projections are
    --lora.merge           also write base + adapters as a full Hugging Face directory (hf/step-N)
    --lora.adapter DIR     start the adapters from a peft adapter directory (its rank, alpha and
                           target modules apply); ignored when the run resumes from a step checkpoint

:class:`LoRASetup` turns a run's config into a LoRA run's before torchtitan builds anything: the model
spec's config goes through the LoRA converter (``models.lora``: adapters, base frozen; a backend's
model may add its own, as hf-v5's does with peft), its state-dict adapter reads and writes base
checkpoints with the adapters left out, and the checkpoint manager becomes
:class:`~qwen3_titan_common.components.lora_checkpoint.LoRACheckpointManager`, which writes the adapters
in peft's format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan.tools.logging import logger

from qwen3_titan_common.components.lora_checkpoint import LoRACheckpointManager, LoRAExportPlan
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.hf.adapter import check_adapter_shapes, expected_adapter_shapes, open_adapter_dir
from qwen3_titan_common.hf.start import absolute
from qwen3_titan_common.models.lora import (
    ATTENTION_TARGETS,
    HF_TARGETS,
    MLP_TARGETS,
    LoRAConverter,
    LoRAParams,
    lora_state_dict_adapter,
)


@dataclass(kw_only=True, slots=True)
class LoRAOptions:
    rank: int = 0
    """Adapter rank; 0 trains every weight (full fine-tuning)."""

    alpha: float = 16.0
    """Adapters are scaled by alpha / rank (peft's lora_alpha)."""

    dropout: float = 0.0
    """Dropout on each adapter's input (peft's lora_dropout)."""

    targets: list[str] = field(default_factory=lambda: list(HF_TARGETS))
    """Hugging Face projection names to adapt (a Qwen3-MoE's routed experts never are)."""

    merge: bool = False
    """Also export base + adapters as a full Hugging Face directory."""

    adapter: str | None = None
    """peft adapter directory to start from (its rank, alpha and targets apply)."""

    @property
    def enabled(self) -> bool:
        return self.rank != 0 or self.adapter is not None

    def __post_init__(self) -> None:
        """One line for a flag that cannot make a LoRA run, as the section is parsed."""
        if not self.enabled:
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                if f.name != "rank" and value != default:
                    shown = ",".join(value) if isinstance(value, list) else value
                    raise UserInputError(
                        f"--lora.{f.name} {shown}: has no effect without --lora.rank R or --lora.adapter DIR "
                        "(--lora.rank 0 trains every weight)"
                    )
            return
        if self.rank < 0:
            raise UserInputError(
                f"--lora.rank {self.rank}: expected a positive rank (or 0: full fine-tuning)"
            )
        if self.alpha <= 0:
            raise UserInputError(f"--lora.alpha {self.alpha}: expected a positive number")
        if not 0.0 <= self.dropout < 1.0:
            raise UserInputError(f"--lora.dropout {self.dropout}: expected a probability in [0, 1)")
        unknown = [t for t in self.targets if t not in HF_TARGETS]
        if unknown or not self.targets:
            raise UserInputError(
                f"--lora.targets {','.join(self.targets)}: expected some of {','.join(HF_TARGETS)}"
            )


def check_lora_layout(parallelism) -> None:
    """One line for a parallel layout LoRA does not run with."""
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(parallelism, name, 1) > 1:
            raise UserInputError(
                f"--parallelism.{name} {getattr(parallelism, name)}: LoRA runs shard with FSDP2 (data parallel), "
                "beside context and expert parallelism, not with tensor or pipeline parallelism; use 1"
            )


def _targets(options: LoRAOptions, is_moe: bool) -> tuple[str, ...]:
    targets = tuple(dict.fromkeys(options.targets))
    if not is_moe:
        return targets
    dropped = [t for t in targets if t in MLP_TARGETS]
    kept = tuple(t for t in targets if t in ATTENTION_TARGETS)
    if dropped:
        logger.info(
            f"[lora] Qwen3-MoE: {','.join(dropped)} not adapted (the MLPs are routed experts, which stay frozen "
            "with the router)"
        )
    if not kept:
        raise UserInputError(
            f"--lora.targets {','.join(targets)}: a Qwen3-MoE's routed experts are not adapted; "
            f"target some of {','.join(ATTENTION_TARGETS)}"
        )
    return kept


@dataclass(frozen=True)
class LoRASetup:
    """What ``--lora.*`` changes in a run's config, resolved once (see the module docstring): the options as
    trained (an adapter directory's own rank, alpha and targets), the converter of the model section, and the
    plan of the checkpoint section."""

    options: LoRAOptions
    converter: LoRAConverter
    export: LoRAExportPlan

    @classmethod
    def resolve(
        cls, options: LoRAOptions, *, parallelism, architecture, model_dir: str | None, resuming: bool
    ) -> LoRASetup | None:
        """The setup of a LoRA run (None when ``--lora`` is off); reads ``--lora.adapter`` and says what it takes
        from it. Refuses a layout LoRA does not run with and an adapter that does not fit the model."""
        if not options.enabled:
            return None
        check_lora_layout(parallelism)
        adapter = open_adapter_dir(options.adapter) if options.adapter else None
        if adapter is not None:
            options = dataclasses.replace(
                options,
                rank=adapter.params.rank,
                alpha=adapter.params.alpha,
                targets=list(adapter.target_modules),
            )
            logger.info(
                f"[lora] rank {options.rank}, alpha {options.alpha:g}, targets {','.join(options.targets)} "
                f"from {adapter.path}"
            )
        targets = _targets(options, architecture.is_moe)
        if adapter is not None:
            check_adapter_shapes(adapter, expected_adapter_shapes(architecture, targets, options.rank))
        base_model = absolute(model_dir) if model_dir else None
        if adapter is not None and resuming:
            logger.info(f"[lora] --lora.adapter {adapter.path} is not loaded (the step checkpoint is newer)")
        elif adapter is not None and adapter.base_model and adapter.base_model != base_model:
            logger.info(
                f"[lora] {adapter.path} was trained on {adapter.base_model}; this run's base is "
                f"{base_model or 'its own initialisation'}"
            )
        params = LoRAParams(rank=options.rank, alpha=options.alpha, dropout=options.dropout)
        converter = LoRAConverter.Config(
            rank=params.rank, alpha=params.alpha, dropout=params.dropout, targets=list(targets)
        ).build()
        export = LoRAExportPlan(
            params=params,
            target_modules=targets,
            merge=options.merge,
            base_model=base_model,
            initial_adapter=None if resuming else adapter,
        )
        return cls(options=options, converter=converter, export=export)

    def model_spec(self, spec):
        """The model spec with adapters on the targets (base frozen), and a state-dict adapter that reads and
        writes base checkpoints with the adapters left out."""
        return dataclasses.replace(
            spec,
            model=self.converter.convert(spec.model),
            state_dict_adapter=lora_state_dict_adapter(spec.state_dict_adapter),
        )

    def checkpoint(self, checkpoint) -> LoRACheckpointManager.Config:
        """The checkpoint section as the manager that also writes the adapters in peft's format."""
        fields = {f.name: getattr(checkpoint, f.name) for f in dataclasses.fields(checkpoint) if f.init}
        return LoRACheckpointManager.Config(**fields, lora=self.export)
