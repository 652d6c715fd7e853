"""The embedded default: a tiny Qwen3, a tokenizer and a corpus, shipped in the package.

Made by ``tools/make_embedded_assets.py``; provenance in ``default/PROVENANCE.md``.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from pathlib import Path

from qwen3_titan_common.arch.architecture import Qwen3Architecture, read_architecture


def default_assets_dir() -> Path:
    return Path(str(files("qwen3_titan_common") / "assets" / "default"))


def default_tokenizer_dir() -> Path:
    return default_assets_dir() / "tokenizer"


def default_corpus_path() -> Path:
    return default_assets_dir() / "corpus" / "corpus.jsonl"


def default_model_dir() -> Path:
    return default_assets_dir() / "model"


@cache
def default_architecture() -> Qwen3Architecture:
    return read_architecture(default_model_dir())
