"""The one ``Qwen3Trainer.Config`` shape every backend's config functions start from.

Backends differ only in how they build a model spec from an architecture; data, tokenizer, optimizer,
schedule, checkpointing and logging are set here, so switching backend changes only
``--module``/``--config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import default_adamw
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.components.checkpoint import Qwen3CheckpointManager
from qwen3_titan_common.components.lr_scheduler import Qwen3LRSchedulers
from qwen3_titan_common.components.metrics import Qwen3Metrics
from qwen3_titan_common.components.validate import Qwen3Validator
from qwen3_titan_common.data import ChatTemplateTokenizer, TextChatDataLoader
from qwen3_titan_common.train.outputs import OutputDefaults
from qwen3_titan_common.train.trainer import (
    HFCheckpointConfig,
    ModelSpecBuilder,
    Qwen3DebugConfig,
    Qwen3Trainer,
)


@dataclass(frozen=True)
class RunShape:
    """What a config function decides besides the model."""

    steps: int
    seq_len: int
    local_batch_size: int
    lr: float
    warmup_steps: int
    checkpoint_interval: int
    dump_folder: str
    seed: int | None = 0
    log_freq: int = 1
    # Recomputation only pays off once activations, not compute, bound the run.
    activation_checkpointing: bool = True
    # Per-block torch.compile where the run is on CUDA: the fastest configuration measured on an H200
    # for every backend (docs/performance.md); the compile costs seconds that a tiny run never recovers.
    compile_on_cuda: bool = False
    # Validation on held-out rows (components.validate) at step 1, every `validation_interval` steps and at
    # the end, reading at most `validation_batches` batches (-1: all of them).
    validation_interval: int = 10
    validation_batches: int = -1


def debug_shape(backend: str, name: str) -> RunShape:
    """The embedded tiny model's run: identical for every backend, so their losses compare step by step."""
    return RunShape(
        steps=30,
        seq_len=256,
        local_batch_size=8,
        lr=3e-3,
        warmup_steps=3,
        checkpoint_interval=30,
        dump_folder=f"./outputs/{backend}-{name}",
        activation_checkpointing=False,
        # 4 validations (steps 1, 10, 20, 30) of 3 batches (6,144 of the held-out part's 17,457 tokens):
        # 12 forward passes of about a third of a training step each, the compute of 4 of the 30 steps; the
        # target is <= 10% of the run's wall time, start-up included (tools/bench_eval.py, docs/performance.md).
        validation_interval=10,
        validation_batches=3,
    )


def real_size_shape(backend: str, name: str) -> RunShape:
    """Published model sizes: fine-tuning defaults, checkpoints every 200 steps."""
    return RunShape(
        steps=1000,
        seq_len=4096,
        local_batch_size=1,
        lr=3e-5,
        warmup_steps=50,
        checkpoint_interval=200,
        dump_folder=f"./outputs/{backend}-{name}",
        log_freq=10,
        compile_on_cuda=True,
        # A forward pass costs about a third of a training step: 10 batches every 100 steps add about 3%.
        validation_interval=100,
        validation_batches=10,
    )


# Where the recipe downloads Qwen3-4B-Instruct-2507 (`hf download ... --local-dir`).
QWEN3_4B_2507_DIR = Path("assets/hf/Qwen3-4B-Instruct-2507")


def qwen3_4b_2507_checkpoint() -> HFCheckpointConfig:
    """The recipe's starting point: its local directory, and how to fetch it when absent."""
    return HFCheckpointConfig(
        model_dir=str(QWEN3_4B_2507_DIR),
        download_hint=f"hf download Qwen/Qwen3-4B-Instruct-2507 --local-dir {QWEN3_4B_2507_DIR}",
    )


def build_trainer_config(
    arch: Qwen3Architecture,
    flavor: str,
    model_spec_builder: ModelSpecBuilder,
    *,
    assets_path: Path,
    shape: RunShape,
    hf: HFCheckpointConfig | None = None,
    trainer: type[Qwen3Trainer] = Qwen3Trainer,
    **backend_fields: Any,
) -> Qwen3Trainer.Config:
    """A backend's run: ``trainer`` (``Qwen3Trainer`` or a backend's subclass) picks the Config class, and
    ``backend_fields`` fill that subclass's own fields. ``hf.model_dir``, when set, replaces ``arch`` with the
    directory's own at Trainer start."""
    from qwen3_titan_common.perf.precision import default_compute_precision
    from qwen3_titan_common.runtime.device import detect_device

    vocab_size = arch.vocab_size
    device_kind = detect_device().kind
    return trainer.Config(
        model_spec=model_spec_builder(arch, flavor),
        architecture=arch,
        model_spec_builder=model_spec_builder,
        hf=hf or HFCheckpointConfig(),
        output_defaults=OutputDefaults(shape.dump_folder, hf.model_dir if hf else None),
        hf_assets_path=str(assets_path),
        dump_folder=shape.dump_folder,
        metrics=Qwen3Metrics.Config(log_freq=shape.log_freq),
        # Plain cross-entropy: the same loss for every backend, so losses compare.
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab_size),
        # torchtitan's tokenizer, its chat template rendered by transformers ({% generation %} included).
        tokenizer=ChatTemplateTokenizer.Config(),
        dataloader=TextChatDataLoader.Config(),
        optimizer=default_adamw(lr=shape.lr),
        lr_scheduler=Qwen3LRSchedulers.Config(
            warmup_steps=shape.warmup_steps,
            decay_ratio=0.8,
            decay_type="cosine",
            min_lr_factor=0.1,
        ),
        training=TrainingConfig(
            local_batch_size=shape.local_batch_size,
            seq_len=shape.seq_len,
            steps=shape.steps,
            # bf16 only where the device computes it fast: a CPU without bf16 matrix instructions runs
            # torch's bf16 GEMM about 100x slower than fp32 (perf.precision).
            mixed_precision_param=default_compute_precision(device_kind).dtype,
        ),
        checkpoint=Qwen3CheckpointManager.Config(
            enable=True,
            interval=shape.checkpoint_interval,
            last_save_model_only=False,
        ),
        validator=Qwen3Validator.Config(
            enable=True, freq=shape.validation_interval, steps=shape.validation_batches
        ),
        activation_checkpoint=SelectiveAC.Config() if shape.activation_checkpointing else None,
        compile=CompileConfig(enable=shape.compile_on_cuda and device_kind == "cuda"),
        # Structured logs are Meta-internal tooling, written before any check could stop a bad run.
        debug=Qwen3DebugConfig(seed=shape.seed, enable_structured_logging=False),
        **backend_fields,
    )
