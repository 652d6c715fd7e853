"""Data-parallel ranks split each epoch without overlap; a checkpointed position resumes exactly."""

import json
import pickle
import re
from collections import Counter

import pytest
import torch
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.data import DatasetError, TextChatDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

SEQ_LEN = 48
BATCH = 2


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(default_tokenizer_dir()))


def _texts(n):
    return [f"text {i}: " + "word " * (i % 13) + f"end of {i}." for i in range(n)]


def _chat_record(i):
    return {
        "messages": [
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    }


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(37)))
    return path


@pytest.fixture
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(_chat_record(i)) + "\n" for i in range(23)))
    return path


def _loader(tokenizer, path, rank=0, world=1, batch=BATCH, **config):
    return TextChatDataLoader.Config(dataset=str(path), **config).build(
        dp_world_size=world, dp_rank=rank, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=batch
    )


def _stream_documents(tokenizer, batches):
    """Rebuilds the packed token stream (each trained input, and the EOS that a document's last label is)
    and splits it into documents."""
    stream = []
    for inputs, labels in batches:
        for row_inputs, row_labels in zip(inputs["input"].tolist(), labels.tolist(), strict=True):
            for token, label in zip(row_inputs, row_labels, strict=True):
                if label != IGNORE_INDEX:
                    stream.append(token)
                    if label == tokenizer.eos_id:
                        stream.append(label)
    text = tokenizer.decode(stream, skip_special_tokens=False)
    return [d for d in text.split("<|endoftext|>") if d]


def _questions(tokenizer, batches):
    """The conversations' numbers, in row order (several conversations to a row)."""
    text = "".join(tokenizer.decode(row) for inputs, _ in batches for row in inputs["input"].tolist())
    return re.findall(r"Question (\d+)\?", text)


def test_two_ranks_split_a_text_epoch_without_overlap(tokenizer, text_file):
    seen = []
    for rank in range(2):
        batches = list(_loader(tokenizer, text_file, rank, 2, infinite=False, on_bad_record="stop"))
        seen.append(_stream_documents(tokenizer, batches))
    assert not set(seen[0]) & set(seen[1])
    assert Counter(seen[0] + seen[1]) == Counter(_texts(37))  # every document once, no token lost


def test_two_ranks_split_a_chat_epoch_without_overlap(tokenizer, chat_file):
    def questions(rank):
        # Batches of one: with larger ones a finite run drops its last, incomplete batch.
        return _questions(tokenizer, _loader(tokenizer, chat_file, rank, 2, batch=1, infinite=False))

    rank0, rank1 = questions(0), questions(1)
    assert (len(rank0), len(rank1)) == (12, 11)
    assert not set(rank0) & set(rank1)
    assert sorted(rank0 + rank1, key=int) == [str(i) for i in range(23)]


def test_rank_shares_cover_each_epoch_exactly(tokenizer, chat_file):
    shares = [_loader(tokenizer, chat_file, rank, 3).dataset for rank in range(3)]
    for epoch in range(3):
        parts = [d.share(epoch).tolist() for d in shares]
        assert sorted(sum(parts, [])) == list(range(23))
    # A new order each epoch, the same one in every run.
    assert shares[0].share(0).tolist() != shares[0].share(1).tolist()
    assert shares[0].share(1).tolist() == _loader(tokenizer, chat_file, 0, 3).dataset.share(1).tolist()


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for (inputs_a, labels_a), (inputs_b, labels_b) in zip(batches_a, batches_b, strict=True):
        assert inputs_a.keys() == inputs_b.keys()
        for key in inputs_a:
            assert torch.equal(inputs_a[key], inputs_b[key])
        assert torch.equal(labels_a, labels_b)


@pytest.mark.parametrize("kind", ["text", "chat"])
@pytest.mark.parametrize("stop_after", [3, 17])  # mid-epoch, and past the first epoch
def test_resume_continues_exactly_where_it_stopped(tokenizer, text_file, chat_file, kind, stop_after):
    path = text_file if kind == "text" else chat_file
    uninterrupted = _take(iter(_loader(tokenizer, path, 1, 2)), stop_after + 15)

    first = _loader(tokenizer, path, 1, 2)
    iterator = iter(first)
    before = _take(iterator, stop_after)
    # What torchtitan's checkpointer stores: the loader's state, pickled per dp rank.
    saved = pickle.loads(pickle.dumps(first.state_dict()))
    if kind == "chat":
        assert saved["dp_rank_1"]  # conversations waiting for a row are part of the position

    resumed = _loader(tokenizer, path, 1, 2)
    resumed.load_state_dict(saved)
    after = _take(iter(resumed), 15)
    _same(before + after, uninterrupted)
    if stop_after == 17:
        assert resumed.dataset.epoch >= 1


def test_resume_refuses_other_data(tokenizer, text_file, chat_file):
    first = _loader(tokenizer, text_file)
    _take(iter(first), 2)
    other = _loader(tokenizer, chat_file)
    other.load_state_dict(first.state_dict())  # applied when iteration starts
    with pytest.raises(DatasetError, match="resume with the same data"):
        next(iter(other))


def test_workers_split_a_rank_share_without_overlap(tokenizer, chat_file):
    loader = _loader(tokenizer, chat_file, 1, 2, batch=1, infinite=False, num_workers=2)
    questions = _questions(tokenizer, loader)
    rank1_share = sorted(str(i) for i in loader.dataset.share(0).tolist())  # in this process: no worker split
    assert sorted(questions) == rank1_share


def test_finite_loader_iterated_again_gives_the_next_epoch(tokenizer, chat_file):
    loader = _loader(tokenizer, chat_file, batch=1, infinite=False)
    epochs = [_questions(tokenizer, loader) for _ in range(2)]
    assert len(epochs[0]) == len(epochs[1]) == 23
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])
