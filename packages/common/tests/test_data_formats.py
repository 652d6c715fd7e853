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


def test_jsonl_text_is_packed_with_eos_between_documents(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts(40)])
    batches = _batches(_loader(tokenizer, path, shuffle=False), 12)  # several epochs of 40 short texts
    _assert_fixed_shapes(batches)
    inputs, labels = batches[0]
    # Packed text trains every position; labels are the inputs shifted by one.
    assert (labels != IGNORE_INDEX).all()
    assert torch.equal(inputs["input"][0, 1:], labels[0, :-1])
    stream = tokenizer.decode(
        inputs["input"][0].tolist() + inputs["input"][1].tolist(), skip_special_tokens=False
    )
    assert stream.startswith(_texts(1)[0] + "<|endoftext|>Document 1 says")


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


def test_chat_jsonl_rows_are_padded_one_conversation_each(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in _chats(9)])
    batches = _batches(_loader(tokenizer, path, shuffle=False), 5)
    _assert_fixed_shapes(batches)
    inputs, labels = batches[0]
    row = inputs["input"][0].tolist()
    assert tokenizer.decode(row, skip_special_tokens=False).startswith(
        "<|im_start|>user\nWhat is 0 plus one?<|im_end|>\n<|im_start|>assistant\nIt is 1.<|im_end|>\n<|endoftext|>"
    )
    # Padding (EOS) at the end, its labels ignored.
    assert row[-1] == tokenizer.eos_id and labels[0, -1] == IGNORE_INDEX


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


def test_per_document_positions_restart_after_eos(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts(20)])
    inputs, _ = _batches(_loader(tokenizer, path, per_document_positions=True), 1)[0]
    tokens, positions = inputs["input"][0].tolist(), inputs["positions"][0].tolist()
    assert positions[0] == 0
    for t in range(1, SEQ_LEN):
        expected = 0 if tokens[t - 1] == tokenizer.eos_id else positions[t - 1] + 1
        assert positions[t] == expected
    assert "positions" not in _batches(_loader(tokenizer, path), 1)[0][0]
