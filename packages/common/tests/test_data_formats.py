"""Every supported source loads and gives batches of exactly (local_batch_size, seq_len)."""

import json

import pytest
import torch
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.data import TextChatDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

SEQ_LEN = 64
BATCH = 4


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(default_tokenizer_dir()))


def _texts(n):
    return [
        f"Document {i} says: the quick brown fox number {i} jumps over {i % 7} lazy dogs." for i in range(n)
    ]


def _chats(n):
    return [
        [
            {"role": "user", "content": f"What is {i} plus one?"},
            {"role": "assistant", "content": f"It is {i + 1}."},
        ]
        for i in range(n)
    ]


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _loader(tokenizer, dataset, **config):
    return TextChatDataLoader.Config(dataset=str(dataset), **config).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=BATCH
    )


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _assert_fixed_shapes(batches):
    for inputs, labels in batches:
        assert inputs["input"].shape == (BATCH, SEQ_LEN)
        assert labels.shape == (BATCH, SEQ_LEN)
        assert inputs["input"].dtype == labels.dtype == torch.int64


def test_jsonl_text_is_packed_with_each_document_ending_in_eos(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts(40)])
    batches = _batches(_loader(tokenizer, path, shuffle=False), 12)  # several epochs of 40 short texts
    _assert_fixed_shapes(batches)
    inputs, labels = batches[0]
    tokens, positions = inputs["input"], inputs["positions"]
    # Packed text trains every position: a document's labels are its inputs shifted by one, its last
    # label the EOS; the next document starts at position 0, and EOS is never an input.
    assert (labels != IGNORE_INDEX).all()
    assert not (tokens == tokenizer.eos_id).any()
    inside = positions[0, 1:] != 0
    assert torch.equal(tokens[0, 1:][inside], labels[0, :-1][inside])
    assert (labels[0, :-1][~inside] == tokenizer.eos_id).all() and (~inside).any()
    stream = tokenizer.decode(tokens[0].tolist() + tokens[1].tolist(), skip_special_tokens=False)
    assert stream.startswith(_texts(1)[0] + "Document 1 says")


def test_parquet_text_and_chat_files_and_directory(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": _texts(30), "extra": list(range(30))}), tmp_path / "text.parquet")
    _assert_fixed_shapes(_batches(_loader(tokenizer, tmp_path / "text.parquet"), 5))

    chat_dir = tmp_path / "chat"
    chat_dir.mkdir()
    for part in range(2):
        pq.write_table(pa.table({"messages": _chats(10)}), chat_dir / f"part-{part}.parquet")
    loader = _loader(tokenizer, chat_dir)
    assert len(loader.dataset.source) == 20
    assert loader.dataset.settings.record_format == "chat"
    _assert_fixed_shapes(_batches(loader, 6))


def test_save_to_disk_dataset_and_dataset_dict_split(tmp_path, tokenizer):
    from datasets import Dataset, DatasetDict

    Dataset.from_list([{"text": t} for t in _texts(25)]).save_to_disk(str(tmp_path / "saved"))
    _assert_fixed_shapes(_batches(_loader(tokenizer, tmp_path / "saved"), 4))

    DatasetDict(
        {
            "train": Dataset.from_list([{"messages": m} for m in _chats(12)]),
            "test": Dataset.from_list([{"messages": m} for m in _chats(3)]),
        }
    ).save_to_disk(str(tmp_path / "dict"))
    loader = _loader(tokenizer, tmp_path / "dict")
    assert len(loader.dataset.source) == 12
    _assert_fixed_shapes(_batches(loader, 4))
    assert len(_loader(tokenizer, tmp_path / "dict", split="test").dataset.source) == 3


def _chat_text(i):
    return f"<|im_start|>user\nWhat is {i} plus one?<|im_end|>\n<|im_start|>assistant\nIt is {i + 1}.<|im_end|>\n"


def test_chat_jsonl_conversations_are_packed_whole(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in _chats(8)])
    batches = _batches(_loader(tokenizer, path, shuffle=False, infinite=False), 1)
    _assert_fixed_shapes(batches)
    inputs, labels = batches[0]
    conversations = []
    for row in range(BATCH):
        tokens, positions = inputs["input"][row], inputs["positions"][row].tolist()
        starts = [t for t in range(SEQ_LEN) if positions[t] == 0] + [SEQ_LEN]
        for start, end in zip(starts, starts[1:], strict=False):
            if (labels[row, start:end] != IGNORE_INDEX).any():  # the last segment may be padding
                conversations.append(tokenizer.decode(tokens[start:end].tolist(), skip_special_tokens=False))
    # Whole conversations, several to a row (8 chats of 24 tokens: two in each row of 64), none cut.
    assert sorted(conversations) == sorted(_chat_text(i) for i in range(8))
    # Padding (EOS) at the end of a row, its labels ignored.
    assert inputs["input"][0, -1] == tokenizer.eos_id and labels[0, -1] == IGNORE_INDEX


def test_chat_without_packing_is_one_conversation_per_row(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in _chats(9)])
    inputs, labels = _batches(_loader(tokenizer, path, shuffle=False, packing=False), 1)[0]
    for i in range(BATCH):
        row = inputs["input"][i].tolist()
        assert tokenizer.decode(row, skip_special_tokens=False).startswith(_chat_text(i) + "<|endoftext|>")
        assert row[-1] == tokenizer.eos_id and labels[i, -1] == IGNORE_INDEX
        assert inputs["positions"][i].tolist().count(0) == 2  # the conversation, then the padding


def test_directory_of_jsonl_reads_only_the_named_split(tmp_path, tokenizer):
    _write_jsonl(tmp_path / "data" / "train-00000.jsonl", [{"text": t} for t in _texts(8)])
    _write_jsonl(tmp_path / "data" / "train-00001.jsonl", [{"text": t} for t in _texts(5)])
    _write_jsonl(tmp_path / "data" / "test-00000.jsonl", [{"text": t} for t in _texts(3)])
    _write_jsonl(tmp_path / ".cache" / "huggingface" / "x.json", [{"junk": 1}])  # hf download metadata
    assert len(_loader(tokenizer, tmp_path).dataset.source) == 13
    assert len(_loader(tokenizer, tmp_path, split="test").dataset.source) == 3


def test_default_is_the_embedded_corpus(tokenizer):
    loader = TextChatDataLoader.Config().build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=BATCH
    )
    assert loader.dataset.settings.record_format == "text"
    _assert_fixed_shapes(_batches(loader, 3))


def test_finite_run_keeps_the_shape_to_the_end(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts(11)])
    batches = list(_loader(tokenizer, path, infinite=False))
    assert batches
    _assert_fixed_shapes(batches)


def test_positions_restart_at_each_document_and_row(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts(20)])
    for packing in (True, False):
        inputs, labels = _batches(_loader(tokenizer, path, packing=packing, shuffle=False), 1)[0]
        for row in range(BATCH):
            positions, row_labels = inputs["positions"][row].tolist(), labels[row].tolist()
            assert positions[0] == 0
            for t in range(1, SEQ_LEN):
                # A document ends with the label EOS; padding (ignored labels) is one document of its own.
                ended = row_labels[t - 1] == tokenizer.eos_id
                padding_starts = row_labels[t] == IGNORE_INDEX != row_labels[t - 1]
                expected = 0 if ended or padding_starts else positions[t - 1] + 1
                assert positions[t] == expected, (packing, row, t)


def test_without_packing_each_row_holds_one_document(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts(8)])
    inputs, labels = _batches(_loader(tokenizer, path, packing=False, shuffle=False), 1)[0]
    for row in range(BATCH):
        trained = (labels[row] != IGNORE_INDEX).nonzero().flatten()
        text = tokenizer.decode(inputs["input"][row, : int(trained[-1]) + 1].tolist())
        assert text == _texts(8)[row]
        assert labels[row, trained[-1]] == tokenizer.eos_id
        assert (labels[row, int(trained[-1]) + 1 :] == IGNORE_INDEX).all()
