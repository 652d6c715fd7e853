"""Chat loss is on assistant tokens only, checked token by token against an independent computation.

The expectation is built with transformers' own tokenizer and chat-template rendering: the
tokens of ``render(turns before i) + generation prompt`` are the prompt, those up to the end
of ``render(turns through i)`` (less the newline after ``<|im_end|>``) are the assistant's.
"""

import json

import pytest
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.data import TextChatDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

SEQ_LEN = 128
TWO_TURNS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another, larger one?"},
    {"role": "assistant", "content": "Eleven is prime too."},
]


@pytest.fixture(scope="module")
def titan_tokenizer():
    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(default_tokenizer_dir()))


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))


def _expected(hf, messages):
    def ids(text):
        return hf(text, add_special_tokens=False)["input_ids"]

    full = ids(hf.apply_chat_template(messages, tokenize=False))
    assistant = set()
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(ids(hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)))
            end = len(ids(hf.apply_chat_template(messages[: i + 1], tokenize=False).removesuffix("\n")))
            assistant.update(range(start, end))
    tokens = full + [hf.eos_token_id]
    labels = [tokens[t + 1] if t + 1 in assistant else IGNORE_INDEX for t in range(len(tokens) - 1)]
    return tokens[:-1], labels


def _first_row(tmp_path, tokenizer, messages):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    # One conversation per row: the row is the conversation alone (packed rows hold the same, test_data_chat_qwen3).
    loader = TextChatDataLoader.Config(dataset=str(path), packing=False).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=1
    )
    inputs, labels = next(iter(loader))
    return inputs["input"][0].tolist(), labels[0].tolist()


def test_two_turn_mask_matches_prefix_rendering_token_by_token(tmp_path, titan_tokenizer, hf_tokenizer):
    inputs, labels = _first_row(tmp_path, titan_tokenizer, TWO_TURNS)
    expected_inputs, expected_labels = _expected(hf_tokenizer, TWO_TURNS)
    n = len(expected_inputs)
    assert inputs[:n] == expected_inputs
    for t in range(n):
        assert labels[t] == expected_labels[t], f"position {t}: token {hf_tokenizer.decode([inputs[t]])!r}"
    # The rest is padding: EOS inputs, nothing trained.
    assert inputs[n:] == [titan_tokenizer.eos_id] * (SEQ_LEN - n)
    assert labels[n:] == [IGNORE_INDEX] * (SEQ_LEN - n)

    # What is trained reads back as the two answers, each with its end-of-turn token.
    trained = [tok for tok in labels if tok != IGNORE_INDEX]
    assert hf_tokenizer.decode(trained) == "Seven.<|im_end|>Eleven is prime too.<|im_end|>"


def test_truncated_chat_keeps_the_shape_and_the_mask(tmp_path, titan_tokenizer, hf_tokenizer):
    long_answer = [TWO_TURNS[1], {"role": "assistant", "content": "prime " * 200}]
    inputs, labels = _first_row(tmp_path, titan_tokenizer, long_answer)
    expected_inputs, expected_labels = _expected(hf_tokenizer, long_answer)
    assert len(inputs) == len(labels) == SEQ_LEN
    assert inputs == expected_inputs[:SEQ_LEN]
    assert labels == expected_labels[:SEQ_LEN]
