"""One packed stream dealt to the data-parallel ranks: every layout trains the rows one rank trains, and a
checkpointed position resumes exactly, on any number of ranks."""

import json
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


def _global_batches(tokenizer, path, world, batch, steps, microbatches=1, **config):
    """The first ``steps`` global batches of a ``world``-rank layout: each rank's ``microbatches`` loader
    batches of ``batch`` rows, the ranks' rows side by side, as one (rows, seq_len) inputs/labels/positions."""
    iterators = [iter(_loader(tokenizer, path, rank, world, batch, **config)) for rank in range(world)]
    steps_out = []
    for _ in range(steps):
        parts = [next(iterators[rank]) for rank in range(world) for _ in range(microbatches)]
        steps_out.append(
            (
                torch.cat([inputs["input"] for inputs, _ in parts]),
                torch.cat([labels for _, labels in parts]),
                torch.cat([inputs["positions"] for inputs, _ in parts]),
            )
        )
    return steps_out


def _as_rows(batch):
    """A global batch as a sorted list of rows: which rank holds which row does not change the step."""
    inputs, labels, positions = batch
    return sorted(zip(inputs.tolist(), labels.tolist(), positions.tolist(), strict=True))


@pytest.mark.parametrize("kind", ["text", "chat"])
@pytest.mark.parametrize("world, batch, microbatches", [(2, 4, 1), (4, 2, 1), (1, 4, 2), (2, 2, 2)])
def test_every_layout_trains_the_rows_one_rank_trains(
    tokenizer, text_file, chat_file, kind, world, batch, microbatches
):
    # Global batch 8 for 12 steps (several epochs of the small files): one rank with batch 8, or `world` ranks
    # of `batch` rows with `microbatches` gradient-accumulation steps each.
    path = text_file if kind == "text" else chat_file
    one_rank = _global_batches(tokenizer, path, 1, 8, 12)
    layout = _global_batches(tokenizer, path, world, batch, 12, microbatches)
    for step, (a, b) in enumerate(zip(one_rank, layout, strict=True), start=1):
        assert _as_rows(a) == _as_rows(b), f"step {step}"


def test_one_pass_holds_every_document_once(tokenizer, text_file):
    batches = list(_loader(tokenizer, text_file, 0, 1, infinite=False, on_bad_record="stop"))
    assert Counter(_stream_documents(tokenizer, batches)) == Counter(_texts(37))  # no token lost


def test_a_finite_pass_ends_on_the_same_batch_on_every_rank(tokenizer, chat_file):
    # 23 conversations do not fill a whole number of 2-rank groups of 3 rows: padding rows complete the last.
    counts = [len(list(_loader(tokenizer, chat_file, rank, 2, batch=3, infinite=False))) for rank in range(2)]
    assert counts[0] == counts[1] > 0
    questions = [
        q
        for rank in range(2)
        for q in _questions(tokenizer, _loader(tokenizer, chat_file, rank, 2, 3, infinite=False))
    ]
    assert sorted(questions, key=int) == [str(i) for i in range(23)]  # every conversation once


def test_each_epoch_has_its_own_order_the_same_in_every_run(tokenizer, chat_file):
    dataset = _loader(tokenizer, chat_file, 0, 3).dataset
    assert sorted(dataset.epoch_order(0).tolist()) == list(range(23))
    assert dataset.epoch_order(0).tolist() != dataset.epoch_order(1).tolist()
    assert (
        dataset.epoch_order(1).tolist() == _loader(tokenizer, chat_file, 2, 3).dataset.epoch_order(1).tolist()
    )


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
    # What torchtitan's checkpointer stores: the loader's state (JSON under one key).
    saved = json.loads(json.dumps(first.state_dict()))
    if kind == "chat":
        # Conversations waiting for a row are part of the position.
        assert json.loads(saved["position"])["dataset_state"]["packer"]["pending"]

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


def test_workers_give_a_rank_the_batches_it_gets_without_them(tokenizer, chat_file):
    with_workers = list(_loader(tokenizer, chat_file, 1, 2, batch=1, infinite=False, num_workers=2))
    without = list(_loader(tokenizer, chat_file, 1, 2, batch=1, infinite=False))
    _same(with_workers, without)


@pytest.mark.parametrize("kind", ["text", "chat"])
@pytest.mark.parametrize("before, after", [((2, 2), (1, 4)), ((1, 4), (4, 1))])
def test_a_position_saved_by_n_ranks_resumes_on_m(tokenizer, text_file, chat_file, kind, before, after):
    """Global batch 4: a position saved after 5 steps of one layout continues the same stream in another."""
    path = text_file if kind == "text" else chat_file
    uninterrupted = _global_batches(tokenizer, path, 1, 4, 11)
    (world, batch), (new_world, new_batch) = before, after
    loaders = [_loader(tokenizer, path, rank, world, batch) for rank in range(world)]
    iterators = [iter(loader) for loader in loaders]
    for _ in range(5):
        for iterator in iterators:
            next(iterator)
    # Every rank holds the same position; each saves it under the one key a checkpoint keeps.
    saved = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
    assert all(state == saved[0] for state in saved) and set(saved[0]) == {"position"}
    resumed = [_loader(tokenizer, path, rank, new_world, new_batch) for rank in range(new_world)]
    for loader in resumed:
        loader.load_state_dict(saved[0])
    iterators = [iter(loader) for loader in resumed]
    for step in range(5, 11):
        parts = [next(iterator) for iterator in iterators]
        rows = _as_rows(
            (
                torch.cat([inputs["input"] for inputs, _ in parts]),
                torch.cat([labels for _, labels in parts]),
                torch.cat([inputs["positions"] for inputs, _ in parts]),
            )
        )
        assert rows == _as_rows(uninterrupted[step]), f"step {step + 1}"


def test_a_per_rank_position_from_an_older_checkpoint_is_refused_in_one_line(tokenizer, text_file):
    loader = _loader(tokenizer, text_file)
    with pytest.raises(DatasetError, match="per-rank share of the records"):
        loader.load_state_dict({"dp_rank_0": b"...", "world_size": 1})


def test_finite_loader_iterated_again_gives_the_next_epoch(tokenizer, chat_file):
    loader = _loader(tokenizer, chat_file, batch=1, infinite=False)
    epochs = [_questions(tokenizer, loader) for _ in range(2)]
    assert len(epochs[0]) == len(epochs[1]) == 23
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == sorted(epochs[1])
