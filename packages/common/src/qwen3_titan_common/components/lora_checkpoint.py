"""The checkpoint manager of a LoRA run: adapters out and in, and the merged model on request.

``LoRACheckpointManager`` is :class:`Qwen3CheckpointManager` (step checkpoints, the disk check, the
Hugging Face export) plus a :class:`LoRAExportPlan`, put in place by ``train.lora.LoRASetup``:

- ``export_hf(step)``, called by the trainer at ``--hf.export_interval`` and at the end, writes the
  adapters to ``<export dir>/adapter-step-N`` in peft's format (``hf/adapter.py``); with
  ``--lora.merge`` also the merged model, each adapted weight ``W + (B @ A) * scaling`` (peft's
  ``merge_and_unload``), as the full directory ``<export dir>/step-N`` through the usual export. A
  run that did not start from a Hugging Face directory exports its frozen base once per process, to
  ``<export dir>/base``, so that its adapters have a base model to load onto;
- ``load()`` runs torchtitan's load (a step checkpoint, or the base weights before step 1), then
  loads ``--lora.adapter`` when the run does not resume;
- step checkpoints are torchtitan's: the whole model and the optimizer state, which holds the
  adapters' moments only, plus the random-number generators' state (:class:`RNGState`): adapter
  dropout draws from them, so a resumed run draws the masks the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import torch.nn as nn
import tyro
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.tools.logging import logger

from qwen3_titan_common.compat import without_checkpoint_wrapper
from qwen3_titan_common.components.checkpoint import Qwen3CheckpointManager
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.adapter import AdapterDir, AdapterSpec, peft_key, write_adapter_dir
from qwen3_titan_common.models.lora import LoRAParams, adapter_key, base_weight_name
from qwen3_titan_common.perf.memory import local_numel

BASE_EXPORT = "base"


@dataclass(frozen=True)
class LoRAExports:
    """What the last export wrote: the adapter, the merged model (``--lora.merge``), the base it applies to."""

    adapter: Path | None
    merged: Path | None
    base: str


@dataclass(frozen=True)
class LoRAExportPlan:
    """What a LoRA run writes beside (or instead of) the full export, from ``--lora.*``."""

    params: LoRAParams
    target_modules: tuple[str, ...]
    merge: bool
    base_model: str | None
    """The Hugging Face directory the run started from; None: the base is exported to <export dir>/base."""
    initial_adapter: AdapterDir | None = None
    """Loaded before step 1 (set only when the run does not resume from a step checkpoint)."""

    @staticmethod
    def adapter_dir(base_dir: Path, step: int) -> Path:
        return base_dir / f"adapter-step-{step}"


class RNGState(Stateful):
    """torch's CPU (and CUDA) generator states, saved in step checkpoints.

    torchtitan seeds once at start and saves no generator state: a model without random ops resumes
    exactly anyway. LoRA dropout is random; restoring the generators after a resume makes step N+1 draw
    the masks the uninterrupted run drew. The restore waits for the model's next forward: between the
    load and that forward torchtitan creates the data iterator, which draws its seed from the global
    generator (the uninterrupted run drew it before step 1). Every data-parallel rank is seeded alike
    and draws alike, so the one copy DCP keeps (from rank 0) is every rank's.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        saved = {key: value.clone() for key, value in state_dict.items()}
        handle = None

        def restore(module, args) -> None:
            handle.remove()
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved:
                torch.cuda.set_rng_state(saved["cuda"])

        handle = self.model.register_forward_pre_hook(restore)


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class LoRACheckpointManager(Qwen3CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3CheckpointManager.Config):
        lora: Annotated[LoRAExportPlan | None, tyro.conf.Suppress] = None
        """Set by ``train.lora.LoRASetup`` from --lora.*."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module], sd_adapter, states, **kwargs) -> None:
        states = {**states, "rng": RNGState(model_parts[0])}
        super().__init__(config, model_parts=model_parts, sd_adapter=sd_adapter, states=states, **kwargs)
        self.lora = config.lora
        self.merging: dict[str, dict[str, torch.Tensor]] | None = None
        self.base_exported = False
        self.exports: LoRAExports | None = None
        self.hf_modules: dict[str, str] = {}
        params = [p for m in model_parts for p in m.parameters()]
        # fp32 weights, and AdamW's two fp32 moments of the trainable (adapter) parameters only.
        self.checkpoint_bytes = 4 * sum(local_numel(p) for p in params) + 8 * sum(
            local_numel(p) for p in params if p.requires_grad
        )

    # -- names -----------------------------------------------------------------------------------

    def _adapter_parameters(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """``(module path, "A" or "B", parameter)`` of every adapter, in the same order on every rank."""
        for name, param in self.export_model_parts[0].named_parameters():
            found = adapter_key(without_checkpoint_wrapper(name))
            if found is not None:
                yield found[0], found[1], param

    def _hf_module(self, module: str) -> str:
        """The Hugging Face module an adapter belongs to (``model.layers.0.self_attn.q_proj``)."""
        if module not in self.hf_modules:
            names = list(self.export_adapter.to_hf({f"{module}.weight": torch.empty(0)}))
            if len(names) != 1:
                raise CheckpointError(f"{module}: no single Hugging Face weight for this adapter ({names})")
            self.hf_modules[module] = names[0].removesuffix(".weight")
        return self.hf_modules[module]

    # -- export ----------------------------------------------------------------------------------

    def _gather_adapters(self, is_writer: bool) -> dict[str, dict[str, torch.Tensor]]:
        adapters: dict[str, dict[str, torch.Tensor]] = {}
        for module, which, param in self._adapter_parameters():
            value = param.full_tensor() if isinstance(param, DTensor) else param  # a collective
            if is_writer:
                adapters.setdefault(module, {})[which] = value.detach().to("cpu", torch.float32)
        return adapters

    def _model_tensors(self, is_writer: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The base model's tensors (adapters left out); while merging, each adapted weight merged."""
        for name, value in super()._model_tensors(is_writer):
            if adapter_key(name) is not None:
                continue
            base = base_weight_name(name)
            pair = (self.merging or {}).get(base.removesuffix(".weight"))
            if pair is not None:
                # peft's merge: W + (B @ A) * scaling.
                merged = value.float().cpu() + (pair["B"] @ pair["A"]) * self.lora.params.scaling
                value = merged.to(value.dtype)
            yield name, value

    def export_hf(
        self, step: int, card: str | None = None, out_dir: Path | None = None, what: str | None = None
    ) -> Path | None:
        """The adapter of ``step`` (returned), the frozen base once when the run has no base directory, and
        with ``--lora.merge`` the merged model; what they are is kept in :attr:`exports` for the summary."""
        plan, lora = self.hf_export, self.lora
        if plan is None or lora is None or out_dir is not None:
            return super().export_hf(step, card=card, out_dir=out_dir, what=what)
        is_writer = _is_writer()
        base_model = lora.base_model
        if base_model is None:
            base_dir = plan.base_dir / BASE_EXPORT
            if not self.base_exported:
                super().export_hf(
                    step, out_dir=base_dir, what="frozen base model (training leaves it unchanged)"
                )
                self.base_exported = True
            base_model = str(base_dir.resolve())
        adapters = self._gather_adapters(is_writer)
        result = None
        if is_writer:
            tensors = {
                peft_key(self._hf_module(module), which): tensor.to(plan.dtype)
                for module, pair in adapters.items()
                for which, tensor in sorted(pair.items())
            }
            spec = AdapterSpec(
                out_dir=lora.adapter_dir(plan.base_dir, step),
                params=lora.params,
                target_modules=lora.target_modules,
                base_model=base_model,
                step=step,
            )
            result = write_adapter_dir(spec, tensors)
            logger.info(f"Exported the LoRA adapter of step {step} to {result} ({len(tensors)} tensors)")
        merged = None
        if lora.merge:
            self.merging = adapters
            try:
                merged = super().export_hf(
                    step, card=card, what=f"merged model (base + adapters) of step {step}"
                )
            finally:
                self.merging = None
        if is_writer:
            self.exports = LoRAExports(adapter=result, merged=merged, base=base_model)
        if dist.is_initialized():
            dist.barrier()
        return result

    # -- continuing from an adapter --------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        try:
            return super()._load(step)
        except (RuntimeError, CheckpointException) as err:
            # DCP's message when this run's adapters are not in the step checkpoint it resumes.
            if "Missing key in checkpoint state_dict" in str(err) and "lora_" in str(err):
                raise CheckpointError(
                    f"{self.folder}: its step checkpoints hold no LoRA adapters (a full fine-tuning run "
                    "wrote them): resume that run without --lora.*, or pass another --dump_folder"
                ) from None
            raise

    def load(self, step: int = -1) -> bool:
        # --lora.adapter is loaded with --checkpoint.enable false too, where torchtitan's load() never calls
        # `_load`: so it follows the public method, whose guard still runs first (super().load).
        loaded = super().load(step)
        if self.lora is not None and self.lora.initial_adapter is not None:
            self._load_adapter(self.lora.initial_adapter)
        return loaded

    def _load_adapter(self, adapter: AdapterDir) -> None:
        tensors = adapter.read()
        where = adapter.path
        count = 0
        with torch.no_grad():
            for module, which, param in self._adapter_parameters():
                key = peft_key(self._hf_module(module), which)
                value = tensors.pop(key, None)
                if value is None:
                    raise CheckpointError(f"{where}: no tensor {key}")
                if tuple(value.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{where}: {key} has shape {list(value.shape)}, expected {list(param.shape)}"
                    )
                value = value.to(param.dtype)
                if isinstance(param, DTensor):
                    # Every rank read the whole (small) file: each keeps its own shard, no communication.
                    value = distribute_tensor(
                        value.to(param.device), param.device_mesh, list(param.placements), src_data_rank=None
                    )
                param.copy_(value)
                count += 1
        if tensors:
            raise CheckpointError(f"{where}: tensor {sorted(tensors)[0]} is not an adapter of this model")
        logger.info(f"[lora] continuing from the adapter in {where} ({count} tensors)")
