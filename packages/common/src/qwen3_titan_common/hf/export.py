"""Writes a complete Hugging Face model directory, shard by shard, atomically.

Tensors arrive one at a time (a trainer gathers each from its shards); at most one
shard is held before it is written, so host memory stays at the model plus one
shard. Everything goes to a hidden temporary directory beside the target, which is
renamed into place only when complete: a killed export never leaves a directory
that looks loadable.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qwen3_titan_common.hf.errors import CheckpointError
from qwen3_titan_common.hf.model_dir import GENERATION_CONFIG, INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES
from qwen3_titan_common.hf.safetensors_writer import write_safetensors

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
# Room for config, tokenizer and filesystem overhead beyond the tensors themselves.
_DISK_MARGIN = 1.05
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
}


def parse_size(text: str, flag: str = "--hf.max_shard_size") -> int:
    """'5GB', '500MB', '2GiB' or a byte count."""
    value = text.strip().upper()
    number = value.rstrip("KMGIB")
    unit = value[len(number) :]
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise CheckpointError(f"{flag} {text!r}: expected a size such as 500MB, 5GB or 2GiB") from None
    if size <= 0:
        raise CheckpointError(f"{flag} {text!r}: expected a positive size")
    return size


@dataclass(frozen=True)
class ExportSpec:
    out_dir: Path
    config: Mapping[str, Any]  # the source config.json, to be updated
    dtype: torch.dtype
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    assets_dir: Path | None = None  # tokenizer / generation_config to copy
    tie_word_embeddings: bool | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_free_space(target_parent: Path, needed_bytes: int, what: str) -> None:
    free = shutil.disk_usage(target_parent).free
    if free < needed_bytes * _DISK_MARGIN:
        raise CheckpointError(
            f"{target_parent}: not enough free disk space for the {what}: needs about "
            f"{needed_bytes * _DISK_MARGIN / 1e9:.2f} GB, {free / 1e9:.2f} GB free"
        )


class _ShardWriter:
    def __init__(self, tmp_dir: Path, dtype: torch.dtype, max_bytes: int):
        self.tmp_dir, self.dtype, self.max_bytes = tmp_dir, dtype, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        if key in self.pending or any(key in keys for _, keys in self.files):
            raise CheckpointError(f"export: tensor '{key}' produced twice")
        self.pending[key] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.tmp_dir / f"shard-{len(self.files):05d}.partial"
        write_safetensors(path, self.pending, metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Give shards their final names; write the index when there is more than one."""
        self.flush()
        if not self.files:
            raise CheckpointError("export: the model produced no tensors")
        if len(self.files) == 1:
            self.files[0][0].rename(self.tmp_dir / SINGLE_FILE)
            return
        count = len(self.files)
        weight_map = {}
        for i, (path, keys) in enumerate(self.files):
            name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path.rename(self.tmp_dir / name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.tmp_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _export_config(spec: ExportSpec) -> dict[str, Any]:
    config = dict(spec.config)
    # Only what the export itself changed: the dtype on disk, and the tie if the run untied it.
    config["dtype"] = _dtype_name(spec.dtype)
    config.pop("torch_dtype", None)
    if spec.tie_word_embeddings is not None:
        config["tie_word_embeddings"] = spec.tie_word_embeddings
    return config


def _copy_assets(assets_dir: Path | None, tmp_dir: Path) -> None:
    if assets_dir is None:
        return
    for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
        source = assets_dir / name
        if source.is_file():
            shutil.copy2(source, tmp_dir / name)


def _replace_dir(tmp_dir: Path, out_dir: Path) -> None:
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
    tmp_dir.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_hf_dir(
    spec: ExportSpec, tensors: Iterable[tuple[str, torch.Tensor]], expected_bytes: int | None = None
) -> Path:
    """Write ``tensors`` (HF key, tensor) and the metadata files to ``spec.out_dir``."""
    out_dir = spec.out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if expected_bytes is not None:
        check_free_space(out_dir.parent, expected_bytes, "export")
    # Leftovers of exports to the same place that were killed: never complete, never read.
    for stale in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp_dir = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    tmp_dir.mkdir()
    try:
        writer = _ShardWriter(tmp_dir, spec.dtype, spec.max_shard_bytes)
        for key, tensor in tensors:
            writer.add(key, tensor)
        writer.finish()
        (tmp_dir / "config.json").write_text(
            json.dumps(_export_config(spec), indent=2, sort_keys=True) + "\n"
        )
        _copy_assets(spec.assets_dir, tmp_dir)
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def iter_state_dict(state_dict: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    yield from state_dict.items()
