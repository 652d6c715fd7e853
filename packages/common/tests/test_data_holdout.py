"""The held-out share of a training source never reaches training, and is the same in every run.

Every record's text repeats a marker naming it (``doc-017``), so the rows each loader emits can be decoded
back to the records they came from.
"""

import json
import re

import numpy as np
import pytest
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.data import DatasetError, TextChatDataLoader
from qwen3_titan_common.data.holdout import held_out_count, held_out_indices
from qwen3_titan_common.data.loader import build_record_stream
from qwen3_titan_common.data.validation import ValidationDataLoader
from torchtitan.components.tokenizer import HuggingFaceTokenizer

RECORDS = 60
SEQ_LEN = 64
MARKER = re.compile(r"doc-(\d{3})")


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(default_tokenizer_dir()))


@pytest.fixture
def marked(tmp_path):
    path = tmp_path / "marked.jsonl"
    lines = [json.dumps({"text": f"doc-{i:03d} " * (5 + i % 17)}) for i in range(RECORDS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _markers(tokenizer, loader, batches) -> set[int]:
    found = set()
    for _, (inputs, _) in zip(range(batches), loader, strict=False):
        for row in inputs["input"]:
            found |= {int(m) for m in MARKER.findall(tokenizer.decode(row.tolist()))}
    return found


def _training(tokenizer, path, rank=0, world=1, **config):
    return TextChatDataLoader.Config(dataset=str(path), **config).build(
        dp_world_size=world, dp_rank=rank, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=4
    )


def _held_out(tokenizer, path, share, **config):
    config = ValidationDataLoader.Config(
        dataset=str(path), split="train", records="held_out", held_out=share, **config
    )
    return config.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=4)


@pytest.mark.parametrize("world", [1, 2])
def test_training_never_reads_a_held_out_record(tokenizer, marked, world):
    share = 0.2
    held_out = _markers(tokenizer, _held_out(tokenizer, marked, share), 10_000)
    assert held_out == set(held_out_indices(RECORDS, share).tolist())
    assert len(held_out) == held_out_count(RECORDS, share) == 12
    trained = set()
    for rank in range(world):
        # Several epochs of each rank's share: every order the run would see, not just the first.
        trained |= _markers(tokenizer, _training(tokenizer, marked, rank, world, held_out=share), 100)
    assert not trained & held_out
    assert trained | held_out == set(range(RECORDS))


def test_the_held_out_records_do_not_depend_on_the_training_order(tokenizer, marked):
    seen = [
        _markers(tokenizer, _training(tokenizer, marked, held_out=0.1, seed=seed, shuffle=shuffle), 100)
        for seed, shuffle in [(0, True), (7, True), (0, False)]
    ]
    assert seen[0] == seen[1] == seen[2]
    assert len(seen[0]) == RECORDS - held_out_count(RECORDS, 0.1)


def test_the_embedded_corpus_keeps_its_held_out_part_out_by_default(tokenizer):
    def records(**config):
        stream = build_record_stream(
            TextChatDataLoader.Config(**config),
            tokenizer=tokenizer,
            seq_len=SEQ_LEN,
            dp_rank=0,
            dp_world_size=1,
        )
        return len(stream.source)

    assert records() == 428 - held_out_count(428, 0.05) == 407
    assert records(held_out=0.0) == 428
    # Other data trains on every record unless validation asks for a share.
    assert held_out_count(428, 0.0) == 0


def test_held_out_indices_are_fixed():
    first = held_out_indices(1000, 0.05)
    assert np.array_equal(first, held_out_indices(1000, 0.05))
    assert len(first) == 50 and np.all(np.diff(first) > 0)
    # A larger share holds out a superset: raising it never moves a held-out record back into training.
    assert set(first) <= set(held_out_indices(1000, 0.1).tolist())


@pytest.mark.parametrize("share", [-0.1, 1.0, 1.5])
def test_a_share_outside_zero_to_one_is_one_line(marked, share):
    with pytest.raises(DatasetError, match=rf"^--dataloader.held_out {share}: expected a share"):
        TextChatDataLoader.Config(dataset=str(marked), held_out=share)


def test_no_held_out_record_is_one_line(tokenizer, tmp_path):
    single = tmp_path / "one.jsonl"
    single.write_text(json.dumps({"text": "only one"}) + "\n")
    with pytest.raises(DatasetError, match="no held-out records for validation .it has a single record"):
        list(_held_out(tokenizer, single, 0.5))
