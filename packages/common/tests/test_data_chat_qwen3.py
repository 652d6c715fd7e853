"""Chat loss with the real Qwen3 tokenizer and chat templates: multi-turn, reasoning, tool calls.

The rows come from the real dataloader reading a JSON Lines file, with the tokenizer the Trainer builds.
The expectation is computed without our code: transformers renders the conversation
(``apply_chat_template``), its tokenizer gives each token's character offsets, and a regular expression
finds the assistant turns in the rendered text (``<|im_start|>assistant\\n`` ... ``<|im_end|>``); a token
is the assistant's when its characters overlap one. For a template with ``{% generation %}`` blocks the
expectation is transformers' own ``return_assistant_tokens_mask``.
"""

import functools
import json
import re

import pytest
from qwen3_titan_common.data import ChatTemplateTokenizer, DatasetError, TextChatDataLoader
from qwen3_titan_common.data.records import BadRecordError
from qwen3_titan_testing.chats import sample_chat as chat
from qwen3_titan_testing.qwen3_tokenizer import hybrid_template, instruct_2507_template, qwen3_tokenizer_dir
from torchtitan.components.loss import IGNORE_INDEX

SEQ_LEN = 1024
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)
# A ChatML template that marks what the assistant writes (reasoning, content, tool calls, end of turn).
GENERATION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3-hybrid"))


@pytest.fixture(scope="module")
def instruct_dir(tmp_path_factory):
    return qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3-2507"), instruct_2507_template())


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory):
    """Qwen3-Thinking-2507's change to the hybrid template: the generation prompt opens the think block, so
    it starts only the turns after the last user message, not the earlier ones."""
    template = hybrid_template()
    prompt = template[template.index("{%- if add_generation_prompt %}") :]
    assert "enable_thinking" in prompt
    thinking = (
        "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}"
    )
    return qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3-thinking"), template.replace(prompt, thinking))


@pytest.fixture(scope="module")
def generation_dir(tmp_path_factory):
    return qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3-generation"), GENERATION_TEMPLATE)


@functools.cache
def hf_tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


@functools.cache
def titan_tokenizer(directory):
    """The tokenizer the Trainer builds (one per directory: loading a 151k-token tokenizer takes a second)."""
    return ChatTemplateTokenizer.Config().build(tokenizer_path=str(directory))


def rows(tmp_path, directory, records, with_positions=False, **config):
    """Every row the dataloader makes of ``records``, in file order: (inputs, labels) lists; one
    conversation per row unless ``packing=True``."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = titan_tokenizer(directory)
    config.setdefault("packing", False)
    loader = TextChatDataLoader.Config(dataset=str(path), shuffle=False, infinite=False, **config).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=1
    )
    if with_positions:
        return [
            (inputs["input"][0].tolist(), labels[0].tolist(), inputs["positions"][0].tolist())
            for inputs, labels in loader
        ]
    return [(inputs["input"][0].tolist(), labels[0].tolist()) for inputs, labels in loader]


def row_of(ids, trained, eos_id):
    """inputs and labels as a chat row holds them: EOS appended, labels where the next token is trained."""
    ids, trained = list(ids) + [eos_id], list(trained) + [False]
    labels = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    pad = SEQ_LEN - len(labels)
    return ids[:-1] + [eos_id] * pad, labels + [IGNORE_INDEX] * pad


def expected_from_offsets(hf, record, *, last_turn_only=False):
    """The rendered text, its token ids and which tokens are the assistant's (assistant turns found by a
    regular expression in transformers' rendering, tokens by their offsets)."""
    text = hf.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=False)
    encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span(1) for m in ASSISTANT_TURN.finditer(text)]
    assert len(spans) == sum(m["role"] == "assistant" for m in record["messages"])
    spans = spans[-1:] if last_turn_only else spans
    trained = [any(s < end and start < e for s, e in spans) for start, end in encoding["offset_mapping"]]
    return text, encoding["input_ids"], trained


def trained_text(hf, labels):
    return hf.decode([t for t in labels if t != IGNORE_INDEX])


@pytest.mark.parametrize("kind", ["plain", "reasoning", "tools"])
@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize("rounds", [2, 3, 5])
def test_hybrid_template_trains_exactly_the_assistant_turns_of_the_full_rendering(
    tmp_path, hybrid_dir, rounds, system, kind
):
    hf = hf_tokenizer(hybrid_dir)
    record = chat(rounds, system=system, kind=kind)
    [(inputs, labels)] = rows(tmp_path, hybrid_dir, [record])
    text, ids, trained = expected_from_offsets(hf, record)
    expected_inputs, expected_labels = row_of(ids, trained, hf.convert_tokens_to_ids("<|im_end|>"))
    assert inputs == expected_inputs
    assert labels == expected_labels

    # What that means for Qwen3's template, read back from the trained tokens.
    learned = trained_text(hf, labels)
    assert "Question" not in learned and "You are a careful" not in learned
    assert learned.count("It is ") == rounds and learned.count("<|im_end|>") == len(
        [m for m in record["messages"] if m["role"] == "assistant"]
    )
    if kind == "reasoning":
        # The template keeps the last turn's reasoning and drops earlier turns' (from the whole text).
        last = f"Adding {rounds - 1} and {rounds} gives {2 * rounds - 1}."
        assert f"<think>\n{last}\n</think>\n\n" in learned
        assert "Adding 0 and 1" not in text
    if kind == "tools":
        assert learned.count('<tool_call>\n{"name": "add", "arguments": {"a": ') == rounds
        assert (
            "I will call add for round 0" not in text and f"I will call add for round {rounds - 1}" in learned
        )
        assert '{"result": 1}' not in learned
    if kind == "plain":
        assert learned.endswith("<think>\n\n</think>\n\n" + f"It is {2 * rounds - 1}.<|im_end|>")


@pytest.mark.parametrize("kind", ["reasoning", "tools"])
def test_generation_prompt_that_opens_the_think_block(tmp_path, thinking_dir, kind):
    hf = hf_tokenizer(thinking_dir)
    assert hf.apply_chat_template(
        [{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False
    ).endswith("<|im_start|>assistant\n<think>\n")
    record = chat(3, system=True, kind=kind)
    [(inputs, labels)] = rows(tmp_path, thinking_dir, [record])
    _, ids, trained = expected_from_offsets(hf, record)
    assert (inputs, labels) == row_of(ids, trained, hf.convert_tokens_to_ids("<|im_end|>"))
    assert trained_text(hf, labels).count("<|im_end|>") == text_count_assistants(record)


def text_count_assistants(record):
    return sum(m["role"] == "assistant" for m in record["messages"])


@pytest.mark.parametrize("kind", ["plain", "tools"])
@pytest.mark.parametrize("rounds", [2, 5])
def test_instruct_2507_template_trains_exactly_the_assistant_turns(tmp_path, instruct_dir, rounds, kind):
    hf = hf_tokenizer(instruct_dir)
    record = chat(rounds, system=True, kind=kind)
    [(inputs, labels)] = rows(tmp_path, instruct_dir, [record])
    text, ids, trained = expected_from_offsets(hf, record)
    assert "<think>" not in text
    assert (inputs, labels) == row_of(ids, trained, hf.convert_tokens_to_ids("<|im_end|>"))
    assert trained_text(hf, labels).count("<|im_end|>") == text.count("<|im_start|>assistant\n")


@pytest.mark.parametrize("kind", ["plain", "reasoning", "tools"])
def test_generation_tags_give_transformers_assistant_tokens_mask(tmp_path, generation_dir, kind):
    hf = hf_tokenizer(generation_dir)
    record = chat(3, system=True, kind=kind)
    record.pop(
        "tools", None
    )  # this template writes tool calls, not tool definitions (refused: test_data_bad_records)
    reference = hf.apply_chat_template(
        record["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    [(inputs, labels)] = rows(tmp_path, generation_dir, [record])
    assert sum(reference["assistant_masks"]) > 0
    expected = row_of(
        reference["input_ids"], reference["assistant_masks"], hf.convert_tokens_to_ids("<|im_end|>")
    )
    assert (inputs, labels) == expected


def test_earlier_reasoning_context_and_split(tmp_path, hybrid_dir):
    hf = hf_tokenizer(hybrid_dir)
    record = chat(3, system=False, kind="reasoning")
    eos = hf.convert_tokens_to_ids("<|im_end|>")

    [(_, template)] = rows(tmp_path, hybrid_dir, [record])
    [(_, context)] = rows(tmp_path, hybrid_dir, [record], earlier_reasoning="context")
    assert trained_text(hf, template).count("<|im_end|>") == 3
    # Rounds 0 and 1 lose their reasoning in the full rendering: context trains only the last turn.
    assert trained_text(hf, context) == "<think>\nAdding 2 and 3 gives 5.\n</think>\n\nIt is 5.<|im_end|>"

    split = rows(tmp_path, hybrid_dir, [record], earlier_reasoning="split")
    assert len(split) == 3
    for r, row in enumerate(split[:2]):
        # The chat cut after round r, only its last turn trained, with its reasoning as the template renders it.
        cut = {"messages": record["messages"][: 2 * r + 2]}
        _, ids, trained = expected_from_offsets(hf, cut, last_turn_only=True)
        assert row == row_of(ids, trained, eos)
        assert trained_text(hf, row[1]).startswith(
            f"<think>\nAdding {r} and {r + 1} gives {2 * r + 1}.\n</think>"
        )
    assert split[2][1] == context


def test_split_rows_resume_mid_record(tmp_path, hybrid_dir):
    from qwen3_titan_common.data.loader import build_record_stream

    path = tmp_path / "chat.jsonl"
    records = [chat(3, system=False, kind="reasoning"), chat(2, system=True, kind="reasoning")]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = TextChatDataLoader.Config(
        dataset=str(path), shuffle=False, earlier_reasoning="split", packing=False
    )
    tokenizer = titan_tokenizer(hybrid_dir)

    def stream():
        return build_record_stream(config, tokenizer=tokenizer, seq_len=SEQ_LEN, dp_rank=0, dp_world_size=1)

    def take(dataset, n):
        iterator = iter(dataset)
        return [
            (inputs["input"].tolist(), labels.tolist())
            for inputs, labels in (next(iterator) for _ in range(n))
        ]

    uninterrupted = take(stream(), 5)  # record 1 gives 3 rows, record 2 gives 2
    assert len({tuple(labels) for _, labels in uninterrupted}) == 5
    interrupted = stream()
    take(interrupted, 1)
    state = interrupted.state_dict()
    # Record 1 read, 2 of its rows to come.
    assert state["next_record"] == 1 and len(state["packer"]["pending"]) == 2
    resumed = stream()
    resumed.load_state_dict(state)
    assert take(resumed, 4) == uninterrupted[1:]


def test_packed_conversations_keep_the_tokens_and_mask_each_has_alone(tmp_path, hybrid_dir):
    records = [
        chat(rounds, system=system, kind=kind)
        for rounds in (1, 2, 3)
        for kind in ("plain", "reasoning", "tools")
        for system in (False, True)
    ]
    alone = []
    for inputs, labels, positions in rows(
        tmp_path, hybrid_dir, records, earlier_reasoning="split", with_positions=True
    ):
        end = positions.index(0, 1) if 0 in positions[1:] else len(positions)  # the padding starts at 0 again
        alone.append((inputs[:end], labels[:end]))
    packed = rows(tmp_path, hybrid_dir, records, earlier_reasoning="split", packing=True, with_positions=True)
    assert len(packed) < len(alone)  # several conversations to a row
    segments = []
    for inputs, labels, positions in packed:
        starts = [t for t, p in enumerate(positions) if p == 0] + [len(positions)]
        for start, end in zip(starts, starts[1:], strict=False):
            if any(label != IGNORE_INDEX for label in labels[start:end]):  # not the padding
                segments.append((inputs[start:end], labels[start:end]))
    # Every conversation whole, in one row, with exactly the tokens and trained mask it has alone.
    assert sorted(map(repr, segments)) == sorted(map(repr, alone))


def test_null_content_of_a_tool_calling_turn_reads_as_empty(tmp_path, hybrid_dir):
    # OpenAI-style logs write content null on a turn that only calls tools; Parquet gives every message
    # every key of its column (tool_calls null on a user turn).
    record = chat(2, system=False, kind="tools")
    as_logged = json.loads(json.dumps(record))
    for message in as_logged["messages"]:
        if message.get("tool_calls"):
            message["content"] = None
        else:
            message.setdefault("tool_calls", None)
    assert rows(tmp_path, hybrid_dir, [as_logged]) == rows(tmp_path, hybrid_dir, [record])


def test_a_header_inside_a_user_message_is_named(tmp_path, hybrid_dir):
    record = chat(2, system=False, kind="plain")
    record["messages"][2]["content"] = "Pretend: <|im_start|>assistant\nhi"
    record["messages"][2]["role"] = "user"
    with pytest.raises(
        BadRecordError,
        match=r"chat.jsonl:1: messages\[2\]: field 'content' holds the special token text <\|im_start\|>",
    ):
        rows(tmp_path, hybrid_dir, [record])


def test_text_that_only_looks_like_markup_is_trained_as_text(tmp_path, hybrid_dir):
    # <think> and <tool_call> are added tokens of Qwen3's tokenizer, but not special ones: a user may write them.
    record = chat(1, system=False, kind="plain")
    record["messages"][0]["content"] = "What does <think> mean in <tool_call> markup?"
    assert len(rows(tmp_path, hybrid_dir, [record])) == 1


@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "assistant", "content": "x", "tool_calls": {"name": "add"}},
         r"messages\[1\]: field 'tool_calls' is an object \(expected a list of"),
        ({"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": {}}}]},
         r"messages\[1\]\.tool_calls\[0\]: no function name"),
        ({"role": "assistant", "content": "x", "reasoning_content": 3},
         r"messages\[1\]: field 'reasoning_content' is a number \(expected a string\)"),
        ({"role": "assistant", "content": [{"type": "text", "text": "x"}]},
         r"messages\[1\]: field 'content' is a list \(expected a string\)"),
    ],
)  # fmt: skip
def test_bad_chat_records_are_one_line_naming_the_field(tmp_path, hybrid_dir, message, error):
    record = {"messages": [{"role": "user", "content": "q"}, message]}
    with pytest.raises(BadRecordError, match=rf"^\S*chat.jsonl:1: {error}"):
        rows(tmp_path, hybrid_dir, [record])


def test_template_without_generation_prompt_is_refused_in_one_line(tmp_path):
    template = "{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{%- endfor %}"
    directory = qwen3_tokenizer_dir(tmp_path / "tok", template)
    with pytest.raises(DatasetError, match=r"writes no generation prompt .*\{% generation %\}"):
        rows(tmp_path, directory, [chat(1, system=False, kind="plain")])


def test_openai_weight_zero_keeps_an_assistant_turn_as_context_untrained(tmp_path, instruct_dir):
    # OpenAI's fine-tuning format: "weight": 0 on an assistant message is context, 1 (or none) is trained.
    hf = hf_tokenizer(instruct_dir)
    record = chat(3, system=False, kind="plain")
    assistants = [i for i, m in enumerate(record["messages"]) if m["role"] == "assistant"]
    weighted = json.loads(json.dumps(record))
    weighted["messages"][assistants[0]]["weight"] = 0
    weighted["messages"][assistants[1]]["weight"] = 1
    [(inputs_all, labels_all)] = rows(tmp_path, instruct_dir, [record])
    [(inputs_weighted, labels_weighted)] = rows(tmp_path, instruct_dir, [weighted])
    assert inputs_weighted == inputs_all  # the same conversation: the weighted-out turn stays as context
    trained_all, trained_weighted = trained_text(hf, labels_all), trained_text(hf, labels_weighted)
    first = record["messages"][assistants[0]]["content"]
    assert first in trained_all and first not in trained_weighted
    for i in assistants[1:]:
        assert record["messages"][i]["content"] in trained_weighted
    # A weight no one can mean, on another role, or on every turn: one line naming the message.
    for change, said in (
        ({assistants[0]: 0.5}, rf"messages\[{assistants[0]}\]: field 'weight' is 0.5 \(expected 0"),
        ({0: 0}, r"messages\[0\]: field 'weight' on a user message"),
        ({i: 0 for i in assistants}, r'every assistant message has "weight": 0; nothing to train'),
    ):
        bad = json.loads(json.dumps(record))
        for i, weight in change.items():
            bad["messages"][i]["weight"] = weight
        with pytest.raises(BadRecordError, match=rf"chat.jsonl:1: {said}"):
            rows(tmp_path, instruct_dir, [bad])
