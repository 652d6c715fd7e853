"""Validation rows are the same on any number of ranks; where they come from follows the documented rules."""

import json

import pytest
import torch
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.data import DatasetError, TextChatDataLoader
from qwen3_titan_common.data.validation import ValidationDataLoader, choose_validation_data
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

SEQ_LEN = 128


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(default_tokenizer_dir()))


def _embedded_held_out(**fields) -> ValidationDataLoader.Config:
    _, config, _ = choose_validation_data(TextChatDataLoader.Config(), ValidationDataLoader.Config(**fields))
    return config


def _batches(config, tokenizer, rank, world, batch):
    loader = config.build(
        dp_world_size=world, dp_rank=rank, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=batch
    )
    return list(loader)


def _scored_rows(batches) -> list[tuple]:
    """(inputs, labels) of every row that has a label, in order."""
    rows = []
    for inputs, labels in batches:
        for row_inputs, row_labels in zip(inputs["input"], labels, strict=True):
            if (row_labels != IGNORE_INDEX).any():
                rows.append((tuple(row_inputs.tolist()), tuple(row_labels.tolist())))
    return rows


@pytest.mark.parametrize(("world", "batch"), [(2, 4), (3, 4), (2, 1), (4, 3)])
def test_ranks_together_read_the_single_rank_rows(tokenizer, world, batch):
    config = _embedded_held_out()
    single = _batches(config, tokenizer, 0, 1, 8)
    per_rank = [_batches(config, tokenizer, rank, world, batch) for rank in range(world)]
    # Every rank runs the same number of full batches: one shape, no rank left waiting.
    assert len({len(b) for b in per_rank}) == 1
    for inputs, labels in (b for batches in per_rank for b in batches):
        assert inputs["input"].shape == labels.shape == (batch, SEQ_LEN)
    # Global batch k is rank 0's batch k, then rank 1's...: together, the single rank's rows in order.
    interleaved = [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(world)]
    assert _scored_rows(interleaved) == _scored_rows(single)
    scored = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in single)
    assert scored == sum(int((labels != IGNORE_INDEX).sum()) for _, labels in interleaved) > 10_000


def test_padding_rows_score_nothing_and_every_pass_is_the_same(tokenizer):
    config = _embedded_held_out()
    loader = config.build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=5
    )
    first, second = list(loader), list(loader)
    assert len(first) == len(second)
    for (a_in, a_lab), (b_in, b_lab) in zip(first, second, strict=True):
        assert torch.equal(a_in["input"], b_in["input"]) and torch.equal(a_lab, b_lab)
    last_inputs, last_labels = first[-1]
    unscored = (last_labels == IGNORE_INDEX).all(dim=1)
    # Only the last batch is filled up, with EOS rows.
    assert int(unscored.sum()) == (-len(_scored_rows(first))) % 5
    assert all((last_inputs["input"][i] == tokenizer.eos_id).all() for i in torch.nonzero(unscored).flatten())


def test_the_embedded_corpus_validates_on_its_held_out_part():
    train, val, line = choose_validation_data(TextChatDataLoader.Config(), ValidationDataLoader.Config())
    assert (val.dataset, val.split, val.records, val.held_out) == ("default", "train", "held_out", 0.05)
    assert train.held_out == 0.05
    assert line == "the held-out 5% of the embedded corpus, never trained on (--dataloader.held_out)"


def _write(path, n=4):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{path.name} {i}"}) + "\n" for i in range(n)))
    return path


def test_a_validation_split_is_preferred_and_training_keeps_every_record(tmp_path):
    _write(tmp_path / "d" / "train.jsonl")
    _write(tmp_path / "d" / "validation.jsonl")
    _write(tmp_path / "d" / "test.jsonl")
    train, val, line = choose_validation_data(
        TextChatDataLoader.Config(dataset=str(tmp_path / "d")), ValidationDataLoader.Config()
    )
    assert (val.split, val.records) == ("validation", "all")
    assert train.held_out is None  # other data: nothing held out of the training split
    assert "split 'validation'" in line


def test_test_split_when_no_validation_split(tmp_path):
    _write(tmp_path / "d" / "train.jsonl")
    _write(tmp_path / "d" / "test.jsonl")
    _, val, _ = choose_validation_data(
        TextChatDataLoader.Config(dataset=str(tmp_path / "d")), ValidationDataLoader.Config()
    )
    assert (val.split, val.records) == ("test", "all")


def test_a_single_file_validates_on_a_held_out_share(tmp_path):
    data = _write(tmp_path / "train.jsonl", 40)
    train, val, line = choose_validation_data(
        TextChatDataLoader.Config(dataset=str(data)), ValidationDataLoader.Config()
    )
    assert train.held_out == val.held_out == 0.05 and val.records == "held_out"
    assert line.startswith(f"the held-out 5% of '{data}'")
    # An explicit share wins over a validation split.
    _write(tmp_path / "d" / "train.jsonl")
    _write(tmp_path / "d" / "validation.jsonl")
    train, val, _ = choose_validation_data(
        TextChatDataLoader.Config(dataset=str(tmp_path / "d"), held_out=0.25), ValidationDataLoader.Config()
    )
    assert (val.split, val.records, val.held_out, train.held_out) == ("train", "held_out", 0.25, 0.25)


def test_a_separate_path_is_read_whole_with_training_record_shape(tmp_path):
    data = _write(tmp_path / "train.jsonl")
    other = _write(tmp_path / "other.jsonl")
    train, val, line = choose_validation_data(
        TextChatDataLoader.Config(dataset=str(data), packing=False),
        ValidationDataLoader.Config(dataset=str(other)),
    )
    assert (val.dataset, val.records, val.packing) == (str(other), "all", False)
    assert train.held_out is None
    assert line == f"all of '{other}'"


def test_bad_validation_sources_are_one_line(tmp_path):
    data = _write(tmp_path / "train.jsonl")
    with pytest.raises(
        DatasetError, match="^--validator.dataloader.split validation: the embedded corpus has no"
    ):
        choose_validation_data(TextChatDataLoader.Config(), ValidationDataLoader.Config(split="validation"))
    with pytest.raises(DatasetError, match="^--dataloader.held_out 0 leaves validation no data"):
        choose_validation_data(
            TextChatDataLoader.Config(dataset=str(data), held_out=0.0), ValidationDataLoader.Config()
        )
    with pytest.raises(DatasetError, match="no such file or directory"):
        ValidationDataLoader.Config(dataset=str(tmp_path / "missing.jsonl"))
