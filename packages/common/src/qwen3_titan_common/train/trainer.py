"""torchtitan's Trainer plus Hugging Face checkpoints in and out.

``Qwen3Trainer.Config`` adds an ``hf`` section to ``Trainer.Config``:

    --hf.model_dir DIR          start from this HF directory (config.json + safetensors)
    --hf.no-export              do not write an HF directory at the end
    --hf.export_dir DIR         where exports go (default <dump_folder>/hf), as step-N/
    --hf.export_interval N      also export every N steps (0: only at the end)
    --hf.export_dtype D         auto (the loaded checkpoint's dtype, else float32),
                                float32, bfloat16 or float16
    --hf.max_shard_size S       e.g. 5GB (default), 500MB

Every backend's config functions return this Config, so the flags are the same for
all of them; a backend supplies ``model_spec_builder`` to rebuild its model from the
checkpoint's architecture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import tyro
from torch.distributed.tensor import DTensor
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.hf.errors import CheckpointError
from qwen3_titan_common.hf.expected_keys import LM_HEAD, check_keys, expected_hf_shapes
from qwen3_titan_common.hf.export import EXPORT_DTYPES, ExportSpec, export_hf_dir, parse_size
from qwen3_titan_common.hf.start import StartPoint, absolute, plan_start
from qwen3_titan_common.train.fsdp_comms import use_sum_reduction_on_gloo

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

    max_shard_size: str = "5GB"
    """Largest safetensors shard, e.g. 5GB, 500MB."""

    download_hint: Annotated[str | None, tyro.conf.Suppress] = None
    """Command that fetches model_dir, quoted when the directory is missing."""


class Qwen3Trainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        hf: HFCheckpointConfig = field(default_factory=HFCheckpointConfig)
        architecture: Annotated[Qwen3Architecture | None, tyro.conf.Suppress] = None
        model_spec_builder: Annotated[ModelSpecBuilder | None, tyro.conf.Suppress] = None

    def __init__(self, config: Config):
        from qwen3_titan_common.train.preflight import check_before_start

        self._start = _prepare_start(config)
        check_before_start(config)
        self.keep_cuda_graphs_capturable(config)
        self._export_dtype = _export_dtype(config, self._start)
        self._max_shard_bytes = parse_size(config.hf.max_shard_size)
        super().__init__(config)
        for part in self.model_parts:  # whatever the backend's parallelize function built
            use_sum_reduction_on_gloo(part)
        self._use_flops_convention(config)
        self._guard_checkpoint_disk()
        if config.hf.export and len(self.model_parts) != 1:
            raise CheckpointError(
                "--hf.export with pipeline parallelism is not supported; pass --hf.no-export"
            )

    @classmethod
    def cuda_graph_blocker(cls, config: Config) -> str | None:
        """Why this run's forward and backward cannot be captured in a CUDA graph, or None.

        torchtitan captures them by default; a backend whose step syncs with the host (a loop over
        data-dependent sizes, a mask built on the host) names the reason here.
        """
        return None

    @classmethod
    def keep_cuda_graphs_capturable(cls, config: Config) -> None:
        """Turn torchtitan's CUDA graphs off, with one log line, where :meth:`cuda_graph_blocker` names a reason."""
        if titan_utils.device_type != "cuda" or config.training.disable_cuda_graphs:
            return
        reason = cls.cuda_graph_blocker(config)
        if reason is not None:
            config.training.disable_cuda_graphs = True
            logger.info(f"[cuda graphs] off for this run: {reason}")

    def _use_flops_convention(self, config: Config) -> None:
        """Replace torchtitan's per-model FLOPs count with the shared one (perf/flops.py)."""
        from qwen3_titan_common.perf.flops import flops_breakdown

        causal = bool(getattr(config.metrics, "flops_causal_halving", False))
        breakdown = flops_breakdown(config.architecture, config.training.seq_len, causal=causal)
        self.metrics_processor.num_flops_per_token = breakdown.per_token
        logger.info(
            f"[metrics] {breakdown.per_token / 1e9:.3f} GFLOP per token: 6 x {breakdown.matmul_params:,} "
            f"matmul parameters + {breakdown.attention_flops:,} attention "
            f"({'causal-halved' if causal else 'not halved'}); {breakdown.total_params:,} parameters in all"
        )

    def _guard_checkpoint_disk(self) -> None:
        """Check free space before each checkpoint torchtitan is about to write, with the numbers."""
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is None or not getattr(checkpointer, "enable", False):
            return
        from torch.distributed.tensor import DTensor

        from qwen3_titan_common.hf.export import check_free_space

        local = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel()
            for m in self.model_parts
            for p in m.parameters()
        )
        # fp32 weights plus AdamW's two fp32 moments, as DCP stores them for this rank.
        needed = local * 4 * 3
        save = checkpointer.save
        folder = Path(self.config.dump_folder) / self.config.checkpoint.folder
        interval = self.config.checkpoint.interval

        def save_with_space_check(curr_step: int, last_step: bool = False, **kwargs):
            if last_step or curr_step % interval == 0:
                folder.mkdir(parents=True, exist_ok=True)
                check_free_space(folder, needed, f"checkpoint of step {curr_step}")
            return save(curr_step, last_step=last_step, **kwargs)

        checkpointer.save = save_with_space_check

    def train_step(self, data_iterator) -> None:
        super().train_step(data_iterator)
        interval = self.config.hf.export_interval
        if (
            self.config.hf.export
            and interval > 0
            and self.step % interval == 0
            and self.step != self.config.training.steps
        ):
            self.export_hf(self.step)

    def train(self):
        super().train()
        if self.config.hf.export:
            self.export_hf(self.step)

    # -- export ---------------------------------------------------------------

    def export_dir_for(self, step: int) -> Path:
        base = self.config.hf.export_dir or str(Path(self.config.dump_folder) / "hf")
        return Path(base) / f"step-{step}"

    def _hf_tensors(self, is_writer: bool) -> Iterator[tuple[str, torch.Tensor]]:
        spec = self.config.model_spec
        adapter = spec.state_dict_adapter(spec.model, None)
        for name, value in self.model_parts[0].state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()  # a collective: every rank takes part
            if not is_writer:
                continue
            value = value.detach().to("cpu", self._export_dtype)
            yield from adapter.to_hf({name: value}).items()

    def export_hf(self, step: int) -> Path | None:
        config = self.config
        arch = config.architecture
        out_dir = self.export_dir_for(step)
        is_writer = not dist.is_initialized() or dist.get_rank() == 0
        tied = bool(getattr(self.model_parts[0], "enable_weight_tying", arch.tie_word_embeddings))
        written: dict[str, tuple[int, ...]] = {}

        def recorded(tensors):
            for key, tensor in tensors:
                written[key] = tuple(tensor.shape)
                yield key, tensor

        result = None
        if is_writer:
            expected = expected_hf_shapes(arch)
            expected_bytes = (
                sum(
                    torch.Size(shape).numel()
                    for key, shape in expected.items()
                    if not (tied and key == LM_HEAD)
                )
                * EXPORT_DTYPES_ITEMSIZE[self._export_dtype]
            )
            spec = ExportSpec(
                out_dir=out_dir,
                config=dict(arch.source),
                dtype=self._export_dtype,
                max_shard_bytes=self._max_shard_bytes,
                assets_dir=Path(config.hf_assets_path),
                tie_word_embeddings=tied,
            )
            result = export_hf_dir(spec, recorded(self._hf_tensors(True)), expected_bytes=expected_bytes)
            # The adapter must not drop a trained tensor (upstream's HF backend loses lm_head).
            check_keys(f"export {result}", expected, written, tied=tied)
            logger.info(
                f"Exported Hugging Face checkpoint of step {step} to {result} ({len(written)} tensors)"
            )
        else:
            for _ in self._hf_tensors(False):
                pass
        if dist.is_initialized():
            dist.barrier()
        return result


EXPORT_DTYPES_ITEMSIZE = {
    dtype: torch.tensor([], dtype=dtype).element_size() for dtype in EXPORT_DTYPES.values()
}


def _export_dtype(config: Qwen3Trainer.Config, start: StartPoint) -> torch.dtype:
    name = config.hf.export_dtype
    if name == "auto":
        name = start.model_dir.dtype_name if start.model_dir is not None else "float32"
    return EXPORT_DTYPES[name]


def _prepare_start(config: Qwen3Trainer.Config) -> StartPoint:
    """Point the config at the run's weights; log the decision in one line."""
    if config.architecture is None or config.model_spec_builder is None:
        raise CheckpointError(
            "Qwen3Trainer.Config needs `architecture` and `model_spec_builder` (set by config functions)"
        )
    start = plan_start(
        model_dir=config.hf.model_dir,
        checkpoint_folder=Path(config.dump_folder) / config.checkpoint.folder,
        checkpoint_enabled=config.checkpoint.enable,
        download_hint=config.hf.download_hint,
    )
    logger.info(f"[start] {start.message}")
    model_dir = start.model_dir
    if config.hf.model_dir and start.kind == "resume":
        # The architecture still comes from the directory the run started from.
        try:
            from qwen3_titan_common.arch.architecture import read_architecture

            config.architecture = read_architecture(absolute(config.hf.model_dir))
            config.model_spec = config.model_spec_builder(config.architecture, config.model_spec.flavor)
        except CheckpointError:
            pass
    if model_dir is None:
        return start
    config.architecture = model_dir.architecture
    config.model_spec = config.model_spec_builder(model_dir.architecture, config.model_spec.flavor)
    if model_dir.has_tokenizer:
        config.hf_assets_path = str(model_dir.path)
    else:
        logger.info(f"[start] {model_dir.path} has no tokenizer files: using {config.hf_assets_path}")
    config.checkpoint = dataclasses.replace(
        config.checkpoint,
        enable=True,
        initial_load_path=str(model_dir.path),
        initial_load_in_hf=True,
        initial_load_model_only=True,
    )
    return start
