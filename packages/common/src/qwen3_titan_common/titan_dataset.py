"""Makes the embedded corpus a named torchtitan dataset.

torchtitan's text dataloader looks dataset names up in its ``DATASETS`` table;
upstream's ``c4_test`` points at ``tests/assets``, which its wheel does not ship.
"""

from __future__ import annotations

from qwen3_titan_common.assets import DEFAULT_DATASET_NAME, default_corpus_path, read_text_jsonl


def _load_jsonl_corpus(path: str):
    from pathlib import Path

    from datasets import Dataset

    # In memory: a few MB, and no arrow cache written under the user's home.
    return Dataset.from_list(read_text_jsonl(Path(path)))


def register_default_dataset() -> str:
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    if DEFAULT_DATASET_NAME not in DATASETS:
        DATASETS[DEFAULT_DATASET_NAME] = DatasetConfig(
            path=str(default_corpus_path()),
            loader=_load_jsonl_corpus,
            sample_processor=lambda sample: sample["text"],
        )
    return DEFAULT_DATASET_NAME
