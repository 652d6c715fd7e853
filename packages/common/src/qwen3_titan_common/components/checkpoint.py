"""torchtitan's checkpoint manager, plus the disk check before each save and the Hugging Face export.

``Qwen3CheckpointManager`` is what ``--checkpoint.*`` builds for every backend (``build_trainer_config``):

- before each step checkpoint torchtitan is about to write, it checks that the folder's disk has room
  for it (fp32 weights and AdamW's two fp32 moments, as DCP stores them) and fails with the numbers;
  a disk that fills up anyway is named in one line; the first save records which model the folder's
  checkpoints hold (``components.model_record``), so that a run of another model refuses to resume from them;
- right after weights are loaded (a Hugging Face directory or a step checkpoint), every parameter is
  checked for NaN/Inf (``components.weight_check``) and the first such one is named;
- ``export_hf(step)`` writes a Hugging Face directory (safetensors shards, config.json, tokenizer) of
  the trained weights through the model's state-dict adapter, the same one torchtitan's own checkpoints
  use; the trainer calls it at ``--hf.export_interval`` and at the end (``train.trainer``).

What and where to export comes from the run's ``--hf.*`` flags as an :class:`HFExportPlan`, which the
trainer puts into this component's Config before anything is built.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.components.model_record import write_model_record
from qwen3_titan_common.components.weight_check import first_non_finite
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.export import ExportSpec, export_hf_dir
from qwen3_titan_common.hf.start import STEP_DIR, newest_complete_step
from qwen3_titan_common.perf.memory import local_numel
from qwen3_titan_common.perf.progress import Phase
from qwen3_titan_common.runtime.disk import check_free_space, disk_full_in, disk_full_message, looks_full


@dataclass(frozen=True)
class HFExportPlan:
    """Where and how a run writes its Hugging Face directories (from ``--hf.*``)."""

    base_dir: Path  # exports go to base_dir/step-N
    architecture: Qwen3Architecture
    dtype: torch.dtype
    max_shard_bytes: int
    assets_dir: Path  # tokenizer and generation config copied into each export
    generation_config: Path | None = None  # the source model's, when assets_dir is not its directory

    def dir_for(self, step: int) -> Path:
        return self.base_dir / f"step-{step}"


def checkpoint_bytes(model_parts: list[nn.Module]) -> int:
    """This rank's share of a step checkpoint as DCP writes it: every state-dict tensor of the model in
    fp32 (a tied weight under both of its names), and AdamW's two fp32 moments per parameter."""
    stored = sum(
        local_numel(t)
        for m in model_parts
        for t in (*(p for _, p in m.named_parameters(remove_duplicate=False)), *m.buffers())
    )
    params = sum(local_numel(p) for m in model_parts for p in m.parameters())
    return 4 * stored + 2 * 4 * params


def _owners(
    held: dict[str, torch.Tensor], pipelined: bool
) -> list[tuple[str, int | None, tuple[int, ...], torch.dtype]]:
    """Every tensor of the model as (name, the rank that sends it to the writer, shape, dtype), in one order
    on every rank; the rank is None where every rank holds every tensor (no pipeline stages: nothing to send)."""
    described = [(name, tuple(value.shape), value.dtype) for name, value in held.items()]
    if not pipelined or not dist.is_initialized() or dist.get_world_size() == 1:
        return [(name, None, shape, dtype) for name, shape, dtype in described]
    everyone: list[list | None] = [None] * dist.get_world_size()
    dist.all_gather_object(
        everyone, [(name, shape, str(dtype).removeprefix("torch.")) for name, shape, dtype in described]
    )
    owners: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    for rank, entries in enumerate(everyone):
        for name, shape, dtype in entries or ():
            owners.setdefault(name, (rank, tuple(shape), getattr(torch, dtype)))
    return [(name, rank, shape, dtype) for name, (rank, shape, dtype) in owners.items()]


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Qwen3CheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        initial_load_model_only: bool = False
        """Load only the model from --checkpoint.initial_load_path (set for you by --hf.model_dir). torchtitan's
        default, True, is warned about by its own check whenever no initial_load_path is given: every run
        that starts from random weights or resumes its own checkpoints."""

        hf_export: Annotated[HFExportPlan | None, tyro.conf.Suppress] = None
        """Set by the trainer from --hf.*: where and how Hugging Face exports are written."""

        model_record: Annotated[dict[str, Any] | None, tyro.conf.Suppress] = None
        """Set by the trainer: which model this run's checkpoints hold (``components.model_record``)."""

        save_steps: Annotated[bool, tyro.conf.Suppress] = True
        """Set by the trainer: False when the manager is enabled only to load --hf.model_dir's weights (torchtitan
        loads an initial checkpoint only through an enabled manager) and --checkpoint.no-enable asked for no
        step checkpoints."""

    def __init__(
        self,
        config: Config,
        *,
        model_parts: list[nn.Module],
        sd_adapter,
        **kwargs,
    ) -> None:
        super().__init__(config, model_parts=model_parts, sd_adapter=sd_adapter, **kwargs)
        self.hf_export = config.hf_export
        self.export_model_parts = model_parts
        self.export_adapter = sd_adapter
        self.model_record = config.model_record
        self.save_steps = config.save_steps
        self.checkpoint_bytes = checkpoint_bytes(model_parts)
        # Pipeline stages hold different layers: an export gathers them (torchtitan hands its trainer over as
        # the "train_state" state, whose parallel_dims say whether the run is pipelined).
        trainer = (kwargs.get("states") or {}).get("train_state")
        self.pipelined = bool(getattr(getattr(trainer, "parallel_dims", None), "pp_enabled", False))
        self.saved_here: set[int] = set()
        self.said_left: set[str] = set()

    # torchtitan's public save()/load() check `enable` once and then call these two hooks, which its own
    # subclasses override (torchtitan.experiments.torchft); whether a step is saved is its `_should_save`.

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self.save_steps or not self._should_save(curr_step, last_step):
            return False
        folder = Path(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        check_free_space(folder, self.checkpoint_bytes, f"checkpoint of step {curr_step}")
        if self.model_record is not None and _is_writer():
            write_model_record(folder, self.model_record)
        try:
            self.saved_here.add(curr_step)
            with Phase(f"checkpoint of step {curr_step} ({self.checkpoint_bytes / 1e9:.2f} GB) to {folder}"):
                return super()._save(curr_step, last_step)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if disk_full_in(err) or looks_full(folder):
                raise CheckpointError(
                    disk_full_message(folder / f"step-{curr_step}", f"checkpoint of step {curr_step}")
                ) from None
            raise

    def _purge_stale_checkpoints(self) -> None:
        """Keep the newest ``--checkpoint.keep_latest_k`` step checkpoints, deleting only what a checkpointer wrote.

        torchtitan's own purge takes every entry whose name holds ``step-N`` anywhere (a user's
        ``step-1-notes/``, a ``step-4.bak`` copy). Here a candidate is a folder named exactly ``step-N``, as
        resuming reads them, that this run saved or that holds DCP's ``.metadata`` (a complete checkpoint,
        this run's or an earlier run's of the same folder); anything else whose name torchtitan would have
        taken is left, and said once."""
        if not self._should_purge():
            return
        folder = Path(self.folder)
        ours: list[tuple[int, Path]] = []
        left: list[str] = []
        for entry in folder.iterdir():
            match = STEP_DIR.match(entry.name)
            if match and entry.is_dir() and not entry.is_symlink():
                step = int(match.group(1))
                if step in self.saved_here or (entry / ".metadata").is_file():
                    ours.append((step, entry))
                    continue
            if re.search(r"step-\d+", entry.name):
                left.append(entry.name)
        for _, path in sorted(ours)[: -self.keep_latest_k]:
            assert self.purge_thread is not None
            self.purge_queue.put(str(path))
        new = sorted(set(left) - self.said_left)
        if new:
            self.said_left.update(new)
            logger.info(
                f"Checkpoint purge (--checkpoint.keep_latest_k {self.keep_latest_k}) deletes only step "
                f"checkpoints; left in {folder}: {', '.join(new)}"
            )

    def _find_load_step(self, folder: str = "") -> int:
        """The step a resume loads: the newest folder named exactly ``step-N`` that reads whole
        (``hf.start.readable_steps``, the step the run's start line named), not torchtitan's newest entry whose
        name holds ``step-N`` anywhere (a ``step-9.bak`` copy) and has a ``.metadata`` (empty, or beside a shard
        cut short); -1 for none."""
        step = newest_complete_step(Path(folder or self.folder))
        return -1 if step is None else step

    def _load(self, step: int = -1) -> bool:
        # Reading a large checkpoint (DCP or Hugging Face) takes minutes with nothing printed; past 5 s
        # a line every 5 s says it is still going.
        with Phase("loading the checkpoint before step 1"):
            try:
                loaded = super()._load(step)
            except (RuntimeError, CheckpointException) as err:
                # DCP's message when a live preference reference's weights are not in the step checkpoint.
                if "Missing key in checkpoint state_dict" in str(err) and "dpo_reference." in str(err):
                    raise CheckpointError(
                        f"{self.folder}: its step checkpoints hold no live reference weights (the run started "
                        "with --dpo.reference precomputed, or without --objective dpo): resume it as it started, "
                        "or pass another --dump_folder"
                    ) from None
                raise
        if loaded:
            bad = first_non_finite(self.export_model_parts)
            if bad is not None:
                resumed = newest_complete_step(Path(self.folder))
                source = f"{self.folder}/step-{resumed}" if resumed is not None else self.initial_load_path
                raise CheckpointError(
                    f"{source}: weight '{bad}' holds NaN or Inf values after loading; training from it would "
                    "give a non-finite loss: use another checkpoint (an earlier step, or the original weights)"
                )
        return loaded

    def save_weights_as_step_zero(self) -> Path:
        """The model's weights as loaded (torchtitan's names, each rank its shards) as the checkpoint ``step-0``:
        torchtitan loads a step-0 checkpoint as weights only, so a run on this checkpoint folder starts from them
        (and ``--checkpoint.initial_load_path`` takes it from another run's folder). What torchtitan users script
        by hand to convert Hugging Face weights; here the trainer's own loading and DCP writing do it."""
        folder = Path(self.folder)
        target = folder / "step-0"
        folder.mkdir(parents=True, exist_ok=True)
        check_free_space(folder, self.checkpoint_bytes, "the converted checkpoint")
        if self.model_record is not None and _is_writer():
            write_model_record(folder, self.model_record)
        with Phase(f"writing the weights ({self.checkpoint_bytes / 1e9:.2f} GB) to {target}"):
            self.dcp_save(
                self.states[MODEL].state_dict(), checkpoint_id=str(target), async_mode=AsyncMode.DISABLED
            )
        return target

    # -- Hugging Face export ---------------------------------------------------------------------

    def _model_tensors(self, is_writer: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's state dict, one full tensor at a time, yielded on the writer only. With pipeline
        parallelism each stage holds its own layers: every tensor then comes to the writer from the first
        rank that holds it (the ranks agree on names, shapes and dtypes first)."""
        held = {name: value for part in self.export_model_parts for name, value in part.state_dict().items()}
        device = next((v.to_local() if isinstance(v, DTensor) else v).device for v in held.values())
        for name, owner, shape, dtype in _owners(held, self.pipelined):
            value = held.get(name)
            if isinstance(value, DTensor):
                # A collective of the ranks holding it: every one of them calls it.
                value = value.full_tensor()
            if owner is not None:
                received = (
                    value.detach()
                    if dist.get_rank() == owner
                    else torch.empty(shape, dtype=dtype, device=device)
                )
                dist.broadcast(received, src=owner)
                value = received
            if is_writer:
                yield name, value.detach()

    def _hf_tensors(self, is_writer: bool) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.hf_export is not None
        for name, value in self._model_tensors(is_writer):
            value = value.to("cpu", self.hf_export.dtype)
            yield from self.export_adapter.to_hf({name: value}).items()

    def export_hf(
        self, step: int, card: str | None = None, out_dir: Path | None = None, what: str | None = None
    ) -> Path | None:
        """Write the model as a Hugging Face directory (``out_dir``, default the plan's for ``step``; ``card``:
        its README.md; ``what``: the log line's name for it); every rank calls it, rank 0 writes."""
        plan = self.hf_export
        if plan is None:
            return None
        arch = plan.architecture
        model = self.export_model_parts[0]
        is_writer = not dist.is_initialized() or dist.get_rank() == 0
        tied = bool(getattr(model, "enable_weight_tying", arch.tie_word_embeddings))
        written: dict[str, tuple[int, ...]] = {}

        def recorded(tensors):
            for key, tensor in tensors:
                written[key] = tuple(tensor.shape)
                yield key, tensor

        result = None
        if is_writer:
            spec = ExportSpec(
                out_dir=out_dir or plan.dir_for(step),
                config=dict(arch.source),
                dtype=plan.dtype,
                max_shard_bytes=plan.max_shard_bytes,
                assets_dir=plan.assets_dir,
                tie_word_embeddings=tied,
                model_card=card,
                generation_config=plan.generation_config,
            )
            # The files are planned from the architecture (config.json): an adapter that drops a trained
            # tensor (upstream's HF backend loses lm_head) or adds one is refused, leaving nothing behind.
            result = export_hf_dir(spec, recorded(self._hf_tensors(True)))
            what = what or f"Hugging Face checkpoint of step {step}"
            logger.info(f"Exported the {what} to {result} ({len(written)} tensors)")
        else:
            for _ in self._hf_tensors(False):
                pass
        if dist.is_initialized():
            dist.barrier()
        return result
