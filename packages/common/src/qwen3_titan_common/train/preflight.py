"""Checks a resolved training config before the Trainer touches anything.

Runs in every rank at the start of ``Qwen3Trainer.__init__``, before torchtitan
initialises distributed, creates the dump folder or reads a weight, so a bad value
costs seconds, writes nothing and ends in one line naming the flag.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.train.layout import resolve_layout


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise UserInputError(f"{flag} {value}: expected a positive integer")


def _check_tokenizer(path: str, vocab_size: int) -> None:
    tokenizer_json = Path(path) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise UserInputError(
            f"hf_assets_path {path}: no tokenizer.json there (expected a Hugging Face tokenizer directory)"
        )
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise UserInputError(
            f"hf_assets_path {path}: the tokenizer has {size} tokens, more than the model's vocab_size {vocab_size}"
        )


def _importable(module: str) -> bool:
    try:
        return bool(module) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package raises
        return False


def _check_override_imports(entries) -> None:
    # Resolve names only; importing is torchtitan's job (and only what the user named).
    for entry in entries:
        name = entry[0] if isinstance(entry, tuple | list) else entry
        if not (_importable(name) or _importable(name.rpartition(".")[0])):
            raise UserInputError(
                f"--override.imports {name}: no such module (expected an importable 'module.function' "
                "or a module defining @override factories)"
            )


def check_before_start(config, world_size: int | None = None) -> None:
    training = config.training
    arch = config.architecture
    _positive("--training.steps", training.steps)
    _positive("--training.local_batch_size", training.local_batch_size)
    _positive("--training.seq_len", training.seq_len)
    if arch is not None and training.seq_len > arch.max_position_embeddings:
        raise UserInputError(
            f"--training.seq_len {training.seq_len}: longer than the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if config.comm.mode == "default":
        resolve_layout(config.parallelism, world_size)
    if arch is not None:
        _check_tokenizer(config.hf_assets_path, arch.vocab_size)
    _check_override_imports(config.override.imports)
    if config.checkpoint.interval < 1:
        raise UserInputError(
            f"--checkpoint.interval {config.checkpoint.interval}: expected a positive integer"
        )
    if config.hf.export_interval < 0:
        raise UserInputError(
            f"--hf.export_interval {config.hf.export_interval}: expected 0 (only at the end) or more"
        )
