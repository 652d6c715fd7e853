"""peft's LoRA adapter directory: written atomically, read back with one-line errors.

The format is peft's own, so ``peft.PeftModel.from_pretrained(base, adapter_dir)`` (or transformers'
``AutoModelForCausalLM.from_pretrained(adapter_dir)`` with peft installed) loads it:

- ``adapter_config.json``: written by peft's ``LoraConfig`` (``r``, ``lora_alpha``, ``lora_dropout``,
  ``target_modules``, ``base_model_name_or_path``, ``task_type`` ``CAUSAL_LM``);
- ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight`` (rank, in) and
  ``.lora_B.weight`` (out, rank) for every adapted ``<module>`` of the Hugging Face model
  (``model.layers.0.self_attn.q_proj``);
- ``README.md``: a note of the base model the adapter belongs to, the step, and how to load it.

Like a model export, the directory is written under a hidden temporary name and renamed into
place when complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.expected_keys import expected_hf_shapes
from qwen3_titan_common.hf.export import _replace_dir, check_free_space, write_export_marker
from qwen3_titan_common.models.lora import HF_TARGETS, LoRAParams

# peft.utils.CONFIG_NAME and SAFETENSORS_WEIGHTS_NAME, spelled out (a test checks them against peft's)
# so that importing this module does not import peft, which costs seconds a run without LoRA would pay.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
README = "README.md"


def peft_key(hf_module: str, which: str) -> str:
    """peft's name for the ``which`` ("A" or "B") matrix of a Hugging Face module's adapter."""
    return f"{PEFT_PREFIX}{hf_module}.lora_{which}.weight"


def expected_adapter_shapes(
    arch: Qwen3Architecture, target_modules: tuple[str, ...], rank: int
) -> dict[str, tuple[int, ...]]:
    """The tensors (peft key -> shape) of a rank-``rank`` adapter of ``target_modules`` on ``arch``."""
    shapes = {}
    for key, shape in expected_hf_shapes(arch).items():
        module = key.removesuffix(".weight")
        if module.rpartition(".")[2] in target_modules and ".experts." not in module:
            out_features, in_features = shape
            shapes[peft_key(module, "A")] = (rank, in_features)
            shapes[peft_key(module, "B")] = (out_features, rank)
    return shapes


def check_adapter_shapes(adapter: AdapterDir, expected: Mapping[str, tuple[int, ...]]) -> None:
    """One line naming the first tensor the model would not take from ``adapter`` as it is."""
    where = adapter.path / ADAPTER_WEIGHTS
    missing = sorted(set(expected) - set(adapter.shapes))
    if missing:
        raise CheckpointError(f"{where}: no tensor {missing[0]} ({len(missing)} missing)")
    unexpected = sorted(set(adapter.shapes) - set(expected))
    if unexpected:
        raise CheckpointError(f"{where}: tensor {unexpected[0]} is not an adapter of this model")
    for key, shape in expected.items():
        if tuple(adapter.shapes[key]) != tuple(shape):
            raise CheckpointError(
                f"{where}: {key} has shape {list(adapter.shapes[key])}, expected {list(shape)}"
            )


@dataclass(frozen=True)
class AdapterSpec:
    out_dir: Path
    params: LoRAParams
    target_modules: tuple[str, ...]
    base_model: str
    """``base_model_name_or_path``: the directory (or hub name) of the model the adapter applies to."""
    step: int


def _readme(spec: AdapterSpec) -> str:
    return (
        f"# LoRA adapter, step {spec.step}\n\n"
        f"Base model: `{spec.base_model}`\n\n"
        f"rank {spec.params.rank}, alpha {spec.params.alpha:g} (scaling {spec.params.scaling:g}), "
        f"dropout {spec.params.dropout:g}; adapted: {', '.join(spec.target_modules)}.\n\n"
        "```python\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM\n\n"
        f'base = AutoModelForCausalLM.from_pretrained("{spec.base_model}")\n'
        f'model = PeftModel.from_pretrained(base, "{spec.out_dir}")\n'
        "```\n"
    )


def lora_config(spec: AdapterSpec):
    """The adapter's ``peft.LoraConfig``."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.params.rank,
        lora_alpha=spec.params.alpha,
        lora_dropout=spec.params.dropout,
        target_modules=sorted(spec.target_modules),
        base_model_name_or_path=spec.base_model,
        task_type="CAUSAL_LM",
        bias="none",
    )


def write_adapter_dir(spec: AdapterSpec, tensors: Mapping[str, torch.Tensor]) -> Path:
    """Write ``tensors`` (peft keys, see :func:`peft_key`) and the adapter's config to ``spec.out_dir``."""
    if not tensors:
        raise CheckpointError(f"adapter export {spec.out_dir}: the model has no adapter tensors")
    out_dir = spec.out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(out_dir.parent, sum(t.numel() * t.element_size() for t in tensors.values()), "adapter")
    tmp_dir = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        contiguous = {key: tensor.detach().cpu().contiguous() for key, tensor in tensors.items()}
        save_file(contiguous, str(tmp_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        lora_config(spec).save_pretrained(str(tmp_dir))
        (tmp_dir / README).write_text(_readme(spec))
        # Last, as for a model export: the mark that lets a later export (a resumed run) replace it.
        write_export_marker(tmp_dir, [f.name for f in tmp_dir.iterdir()])
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


@dataclass(frozen=True)
class AdapterDir:
    """A peft LoRA adapter directory we can continue training from."""

    path: Path
    params: LoRAParams
    target_modules: tuple[str, ...]
    base_model: str | None
    shapes: Mapping[str, tuple[int, ...]]

    def read(self) -> dict[str, torch.Tensor]:
        with safe_open(str(self.path / ADAPTER_WEIGHTS), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}

    def merged(
        self, shard: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``shard`` (Hugging Face keys) with this adapter merged into the weights it adapts, as peft merges
        (``W + B @ A * scaling``, in fp32, back to the weight's dtype): the merged export's arithmetic."""
        out = dict(shard)
        for key, weight in shard.items():
            a_key, b_key = (peft_key(key.removesuffix(".weight"), which) for which in "AB")
            if key.endswith(".weight") and a_key in tensors:
                delta = tensors[b_key].float() @ tensors[a_key].float()
                out[key] = (weight.float() + delta * self.params.scaling).to(weight.dtype)
        return out


# Features of peft's LoraConfig an adapter must leave off: ours is plain LoRA on whole projections.
_PLAIN_LORA = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "target_parameters": None,
}


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """A peft adapter directory rather than a model: its adapter_config.json, and no config.json."""
    folder = Path(path).expanduser()
    return (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file()


def open_adapted_model(
    path: str | os.PathLike,
    base: str | None = None,
    flag: str = "model directory",
    no_base: str | None = None,
):
    """A peft adapter directory as the model it makes: its base (``base``, else the adapter's
    ``base_model_name_or_path``) with the adapter merged as its weights are read (``HFModelDir.adapter``).
    The adapter's tensors are checked against the base's architecture, one line naming the first misfit;
    ``no_base``: what to do when the adapter names no local base (the caller's flag for one; by default
    ``--base``)."""
    import dataclasses

    from qwen3_titan_common.hf.model_dir import open_model_dir

    adapter = open_adapter_dir(path, flag=flag)
    no_base = no_base or "pass --base DIR (the model it adapts)"
    source = base or adapter.base_model
    if not source:
        raise CheckpointError(f"{adapter.path / ADAPTER_CONFIG}: no base_model_name_or_path; {no_base}")
    shown = "--base" if base else f"{adapter.path / ADAPTER_CONFIG}: base_model_name_or_path"
    if not base and not Path(source).expanduser().is_dir():
        raise CheckpointError(f"{shown} {source!r}: not a local directory; {no_base}")
    model = open_model_dir(source, flag=shown)
    check_adapter_shapes(
        adapter, expected_adapter_shapes(model.architecture, adapter.target_modules, adapter.params.rank)
    )
    return dataclasses.replace(model, adapter=adapter)


def open_adapter_dir(path: str | os.PathLike, flag: str = "--lora.adapter") -> AdapterDir:
    """Check a peft adapter directory (config and tensor names, no weight read) in one line per problem."""
    folder = Path(path).expanduser().resolve()
    config_file = folder / ADAPTER_CONFIG
    weights = folder / ADAPTER_WEIGHTS
    for needed in (config_file, weights):
        if not needed.is_file():
            raise CheckpointError(
                f"{flag} {path}: no {needed.name} there (expected a peft LoRA adapter directory)"
            )
    from peft import LoraConfig

    try:
        config = LoraConfig.from_pretrained(str(folder))
    except Exception as err:  # peft raises TypeError/ValueError/KeyError for what it cannot read
        raise CheckpointError(f"{config_file}: not a peft LoRA config ({err})") from None
    if str(getattr(config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        raise CheckpointError(f"{config_file}: peft_type {config.peft_type}, expected LORA")
    for key, plain in _PLAIN_LORA.items():
        value = getattr(config, key, plain)
        if value != plain and not (plain is None and not value):
            raise CheckpointError(f"{config_file}: {key} is {value!r}; expected {plain!r} (plain LoRA)")
    targets = config.target_modules
    if not isinstance(targets, list | set | tuple) or not targets:
        raise CheckpointError(
            f"{config_file}: target_modules {targets!r}; expected a list of projection names"
        )
    unknown = sorted(str(t) for t in targets if t not in HF_TARGETS)
    if unknown:
        raise CheckpointError(
            f"{config_file}: target_modules names {unknown[0]}; expected Qwen3 projections ({','.join(HF_TARGETS)})"
        )
    # What --lora.* would refuse as flags, refused here naming the file (its values replace the flags').
    if isinstance(config.r, bool) or not isinstance(config.r, int) or config.r < 1:
        raise CheckpointError(f"{config_file}: r {config.r!r}; expected a positive rank")
    if not isinstance(config.lora_alpha, int | float) or not config.lora_alpha > 0:
        raise CheckpointError(f"{config_file}: lora_alpha {config.lora_alpha!r}; expected a positive number")
    if not isinstance(config.lora_dropout, int | float) or not 0 <= config.lora_dropout < 1:
        raise CheckpointError(
            f"{config_file}: lora_dropout {config.lora_dropout!r}; expected a probability in [0, 1)"
        )
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as err:  # safetensors raises SafetensorError for a damaged file
        raise CheckpointError(f"{weights}: not a readable safetensors file ({err})") from None
    return AdapterDir(
        path=folder,
        params=LoRAParams(
            rank=int(config.r), alpha=float(config.lora_alpha), dropout=float(config.lora_dropout)
        ),
        target_modules=tuple(sorted(targets)),
        base_model=config.base_model_name_or_path,
        shapes=shapes,
    )
