"""A directory splits as ``datasets.load_dataset(directory)`` splits it; a missing split is one line.

Every record's text is the path of the file that holds it, so comparing the records we read for a split
with the rows ``load_dataset`` gives for it compares which files each puts in the split.
"""

import json
from pathlib import Path

import pytest
from qwen3_titan_common.data import DatasetError
from qwen3_titan_common.data.sources import open_source, resolve_dataset


def _write(root, names):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".parquet":
            pq.write_table(pa.table({"text": [name, name]}), path)
        else:
            path.write_text(json.dumps({"text": name}) + "\n")
    return root


def _ours(root, split):
    resolved = resolve_dataset(str(root), split=split)
    source = open_source(resolved, ["text"], split)
    return sorted(r.value["text"] for r in source.read(range(len(source)))), resolved.note


def _theirs(root, cache):
    from datasets import load_dataset

    loaded = load_dataset(str(root), cache_dir=str(cache))
    return {split: sorted(rows["text"]) for split, rows in loaded.items()}


def _assert_splits_like_datasets(root, cache, expected):
    """Our files per split are ``expected``, and so are load_dataset's."""
    assert _theirs(root, cache) == expected
    for split, texts in expected.items():
        assert _ours(root, split)[0] == texts, split


def test_training_and_testing_names(tmp_path, monkeypatch):
    root = _write(tmp_path / "d", ["training.jsonl", "testing.jsonl"])
    _assert_splits_like_datasets(
        root, tmp_path / "cache", {"train": ["training.jsonl"], "test": ["testing.jsonl"]}
    )
    assert _ours(root, "train")[1] == (
        "reading split 'train' only (1 of 2 data files; splits: train, test; --dataloader.split)"
    )
    # A relative path stays relative, so locations read as the user wrote them.
    monkeypatch.chdir(tmp_path)
    assert resolve_dataset("d").files == (Path("d/training.jsonl"),)


def test_train_validation_test_names(tmp_path):
    root = _write(tmp_path / "d", ["my_train.jsonl", "validation.jsonl", "test-2024.jsonl", "README.md"])
    _assert_splits_like_datasets(
        root,
        tmp_path / "cache",
        {"train": ["my_train.jsonl"], "validation": ["validation.jsonl"], "test": ["test-2024.jsonl"]},
    )


def test_split_named_by_folder(tmp_path):
    root = _write(tmp_path / "d", ["data/train/a.jsonl", "data/train/b.jsonl", "data/dev/c.jsonl"])
    _assert_splits_like_datasets(
        root,
        tmp_path / "cache",
        {"train": ["data/train/a.jsonl", "data/train/b.jsonl"], "validation": ["data/dev/c.jsonl"]},
    )


def test_hub_shard_names(tmp_path):
    shards = [
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/test-00000-of-00001.parquet",
    ]
    root = _write(tmp_path / "d", [*shards, ".cache/huggingface/download/data/train-00000-of-00002.parquet"])
    (root / "README.md").write_text("# a dataset\n")
    _assert_splits_like_datasets(
        root,
        tmp_path / "cache",
        {"train": sorted(shards[:2] * 2), "test": [shards[2]] * 2},  # two rows a file
    )
    # Shards in path order, so a checkpointed record order stays valid.
    assert resolve_dataset(str(root)).files == (root / shards[0], root / shards[1])


def test_no_split_names_reads_every_file_as_train(tmp_path):
    root = _write(tmp_path / "d", ["a.jsonl", "more/b.json", "contest.jsonl"])
    _assert_splits_like_datasets(
        root, tmp_path / "cache", {"train": ["a.jsonl", "contest.jsonl", "more/b.json"]}
    )
    assert _ours(root, "train")[1] is None  # nothing left out, nothing to log


def test_missing_split_is_one_line_naming_the_splits_found(tmp_path):
    root = _write(tmp_path / "d", ["training.jsonl", "testing.jsonl"])
    with pytest.raises(DatasetError) as info:
        resolve_dataset(str(root), split="validation")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"--dataloader.dataset '{root}': no split 'validation' ")
    assert "load_dataset names them: train, test); pass one as --dataloader.split" in message

    unsplit = _write(tmp_path / "u", ["a.jsonl"])
    with pytest.raises(DatasetError, match=r"no split 'test' \(.*names them: train\)"):
        resolve_dataset(str(unsplit), split="test")


def test_split_with_only_other_formats(tmp_path):
    root = _write(tmp_path / "d", ["notes.jsonl"])
    (root / "train.csv").write_text("text\nx\n")  # datasets' train split, a format we do not read
    with pytest.raises(DatasetError, match=r"split 'train' \(as datasets.load_dataset splits .*\) holds no"):
        resolve_dataset(str(root))


def test_file_matched_twice_is_read_once(tmp_path):
    # load_dataset reads this file twice (it matches both 'train' and 'training' patterns).
    root = _write(tmp_path / "d", ["train_training.jsonl", "test.jsonl"])
    assert _ours(root, "train")[0] == ["train_training.jsonl"]


def test_shard_split_that_is_not_a_word(tmp_path):
    root = _write(tmp_path / "d", ["data/my-split-00000-of-00001.jsonl"])
    with pytest.raises(DatasetError) as info:
        resolve_dataset(str(root))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"--dataloader.dataset '{root}': datasets cannot name its splits")


def test_directory_name_with_glob_characters(tmp_path):
    root = _write(tmp_path / "set [1] *", ["train.jsonl", "test.jsonl"])
    assert resolve_dataset(str(root)).files == (root / "train.jsonl",)
