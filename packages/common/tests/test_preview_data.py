"""``preview-data``: the first records of a dataset, which tokens carry loss, before a run is paid for.

Checked against what the real dataloader trains and against transformers' own rendering and offsets.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.data import ChatTemplateTokenizer, TextChatDataLoader
from qwen3_titan_common.scripts.preview_data import main
from qwen3_titan_common.scripts.preview_rows import BOUNDARY_COLOR
from qwen3_titan_common.scripts.trained_text import RESET, TRAINED_CLOSE, TRAINED_OPEN
from qwen3_titan_testing.qwen3_tokenizer import qwen3_tokenizer_dir
from torchtitan.components.loss import IGNORE_INDEX

PREVIEW = str(Path(sys.executable).with_name("preview-data"))
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.S)
RECORDS = [
    {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5.", "reasoning_content": "Two plus three is five."},
            {"role": "user", "content": "And doubled?"},
            {"role": "assistant", "content": "<think>\n5 times 2.\n</think>\n\n10."},
        ]
    },
    {"messages": [{"role": "user", "content": "Nobody answers."}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
]
# --rows: short conversations, several to a row of 128 tokens, and texts of which some outgrow a row of 64.
CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {n} + {n}?"},
            {"role": "assistant", "content": f"{2 * n}."},
        ]
    }
    for n in range(7)
] + [
    {
        "messages": [
            {"role": "user", "content": "Name three colours."},
            {"role": "assistant", "content": "Red, green and blue.", "reasoning_content": "Primary ones."},
        ]
    }
]
TEXTS = [
    "A short note.",
    "Packing puts several documents into one row; " * 6 + "the end.",
    "Caf\u00e9 au lait \u2603 \u65e5\u672c: characters of several bytes.",
    "Third document, a little longer than the first one.",
    "Last.",
]
ROW_HEADER = re.compile(r"== row (\d+): (\d+) documents?, (\d+) tokens \+ (\d+) padding, (\d+) trained")
MARKER = re.compile(r"\u2502doc (\d+)(, continued)?\u2502")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_json_mask_is_what_the_dataloader_trains(qwen3, data, capsys):
    assert main([str(data), "--tokenizer", str(qwen3), "--json"]) == 1  # record 2 would stop training
    first, second, third = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert second == {
        "record": f"{data}:2",
        "error": "chat has no assistant turn (roles: user); nothing to train on",
    }

    loader = TextChatDataLoader.Config(
        dataset=str(data), shuffle=False, infinite=False, on_bad_record="skip", packing=False
    ).build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=ChatTemplateTokenizer.Config().build(tokenizer_path=str(qwen3)),
        seq_len=256,
        local_batch_size=1,
    )
    for shown, (inputs, labels) in zip([first, third], loader, strict=True):
        [row] = shown["rows"]
        n = len(row["ids"])
        assert inputs["input"][0, :n].tolist() == row["ids"]
        # Label t is token t + 1 when that token is trained.
        trained_labels = [
            t if keep else IGNORE_INDEX for t, keep in zip(row["ids"][1:], row["mask"][1:], strict=True)
        ]
        assert labels[0, : n - 1].tolist() == trained_labels
        assert shown["format"] == "chat" and row["mask"][0] == 0


def test_json_mask_matches_the_assistant_turns_of_transformers_rendering(qwen3, data, capsys):
    from transformers import AutoTokenizer

    main([str(data), "--tokenizer", str(qwen3), "--json", "-n", "1"])
    [row] = json.loads(capsys.readouterr().out)["rows"]
    hf = AutoTokenizer.from_pretrained(str(qwen3))
    text = hf.apply_chat_template(RECORDS[0]["messages"], tokenize=False)
    encoding = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [m.span(1) for m in ASSISTANT_TURN.finditer(text)]
    expected = [int(any(s < e and b < f for s, f in spans)) for b, e in encoding["offset_mapping"]]
    assert row["ids"] == encoding["input_ids"]
    assert row["mask"] == expected


def test_terminal_view_marks_exactly_the_assistant_turns(qwen3, data, capsys):
    from transformers import AutoTokenizer

    main([str(data), "--tokenizer", str(qwen3), "--color", "never", "-n", "1"])
    header, *body = capsys.readouterr().out.rstrip("\n").split("\n")
    shown = "\n".join(body)
    assert re.fullmatch(rf"== {re.escape(str(data))}:1 \(chat\): \d+ tokens, \d+ trained", header)
    text = AutoTokenizer.from_pretrained(str(qwen3)).apply_chat_template(
        RECORDS[0]["messages"], tokenize=False
    )
    assert shown.replace(TRAINED_OPEN, "").replace(TRAINED_CLOSE, "") == text.rstrip("\n")
    marked = re.findall(rf"{TRAINED_OPEN}(.*?){TRAINED_CLOSE}", shown, re.S)
    assert marked == [m.group(1) for m in ASSISTANT_TURN.finditer(text)]
    # Qwen3's template: the first answer without its reasoning, the last with it.
    assert marked == ["5.<|im_end|>", "<think>\n5 times 2.\n</think>\n\n10.<|im_end|>"]


def test_split_shows_one_row_per_turn_and_seq_len_cuts_like_training(qwen3, data, capsys):
    main(
        [str(data), "--tokenizer", str(qwen3), "--color", "never", "-n", "1", "--earlier-reasoning", "split"]
    )
    out = capsys.readouterr().out
    assert re.findall(r"row (\d) of 2", out) == ["1", "2"]
    assert f"{TRAINED_OPEN}<think>\nTwo plus three is five.\n</think>\n\n5.<|im_end|>{TRAINED_CLOSE}" in out

    assert main([str(data), "--tokenizer", str(qwen3), "--json", "-n", "1", "--seq-len", "8"]) == 1
    assert json.loads(capsys.readouterr().out)["error"].startswith("assistant text starts at token")
    main([str(data), "--tokenizer", str(qwen3), "--json", "-n", "3", "--seq-len", "12"])
    third = json.loads(capsys.readouterr().out.splitlines()[2])
    assert len(third["rows"][0]["ids"]) == 13 and sum(third["rows"][0]["mask"]) > 0


@pytest.mark.slow
def test_console_script_errors_are_one_line(tmp_path, data):
    missing = subprocess.run([PREVIEW, str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "nope.jsonl': no such file or directory" in missing.stderr
    assert missing.stderr.startswith("preview-data: DATASET '") and "--dataloader." not in missing.stderr
    zero = subprocess.run([PREVIEW, str(data), "--seq-len", "0"], capture_output=True, text=True)
    assert (zero.returncode, zero.stderr) == (2, "preview-data: --seq-len 0: expected a positive number\n")
    no_template = tmp_path / "plain"
    qwen3_tokenizer_dir(no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    refused = subprocess.run(
        [PREVIEW, str(data), "--tokenizer", str(no_template)], capture_output=True, text=True
    )
    assert refused.returncode == 2
    assert (
        refused.stderr == "preview-data: chat records need a chat template: the tokenizer has none; add "
        "`chat_template` to tokenizer_config.json or a chat_template.jinja next to it\n"
    )


# -- --rows: the rows the training dataloader builds -----------------------------------------------


@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    return path


@pytest.fixture
def texts(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def loader_rows(dataset, tokenizer_dir, seq_len, packing, **config):
    """Every row of one pass, in file order, as the Trainer would get them: (inputs, labels, positions)."""
    loader = TextChatDataLoader.Config(
        dataset=str(dataset), shuffle=False, infinite=False, packing=packing, **config
    ).build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=ChatTemplateTokenizer.Config().build(tokenizer_path=str(tokenizer_dir)),
        seq_len=seq_len,
        local_batch_size=1,
    )
    return [
        (inputs["input"][0].tolist(), labels[0].tolist(), inputs["positions"][0].tolist())
        for inputs, labels in loader
    ]


def eos_of(tokenizer_dir) -> int:
    return ChatTemplateTokenizer.Config().build(tokenizer_path=str(tokenizer_dir)).eos_id


def preview_json_rows(capsys, dataset, tokenizer_dir, seq_len, packing):
    packing_flag = [] if packing else ["--no-packing"]
    argv = [str(dataset), "--tokenizer", str(tokenizer_dir), "--rows", "50", "--seq-len", str(seq_len)]
    assert main([*argv, "--json", *packing_flag]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "no-packing"])
@pytest.mark.parametrize("kind", ["chat", "text"])
def test_json_rows_are_the_dataloaders_rows(qwen3, chats, texts, capsys, kind, packing):
    dataset, tokenizer_dir, seq_len = (
        (chats, qwen3, 128) if kind == "chat" else (texts, default_tokenizer_dir(), 64)
    )
    shown = preview_json_rows(capsys, dataset, tokenizer_dir, seq_len, packing)
    rows = loader_rows(dataset, tokenizer_dir, seq_len, packing)
    eos = eos_of(tokenizer_dir)
    assert [row["row"] for row in shown] == list(range(1, len(rows) + 1))  # every row of the pass, numbered
    for row, (inputs, labels, positions) in zip(shown, rows, strict=True):
        documents, padding = row["documents"], row["padding"]
        assert [t for d in documents for t in d["ids"]] + [eos] * padding == inputs
        trained = [int(label != IGNORE_INDEX) for label in labels]
        assert [m for d in documents for m in d["mask"]] + [0] * padding == trained
        # A document starts where positions restart at 0; the padding counts up from 0 as a part of its own.
        starts = [d["start"] for d in documents] + ([seq_len - padding] if padding else [])
        assert starts == [t for t, position in enumerate(positions) if position == 0]
        assert all(len(d["ids"]) == len(d["mask"]) and sum(d["mask"]) for d in documents)
    documents_per_row = [len(row["documents"]) for row in shown]
    if packing:
        assert max(documents_per_row) > 1
    else:
        assert set(documents_per_row) == {1}
    if kind == "chat":
        # Conversations are packed whole: each one is a document of exactly one row.
        assert sum(documents_per_row) == len(CHATS)


def test_a_text_records_mask_is_what_its_row_trains(texts, capsys):
    # A text's first token starts its document, so nothing predicts it; every later token is a label.
    assert main([str(texts), "-n", "1", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["rows"]
    inputs, labels, _ = loader_rows(texts, default_tokenizer_dir(), 256, packing=False)[0]
    n = len(row["ids"])
    assert inputs[:n] == row["ids"]
    assert row["mask"] == [0] + [int(label != IGNORE_INDEX) for label in labels[: n - 1]]
    assert row["mask"][0] == 0 and all(row["mask"][1:])


def test_terminal_rows_show_each_conversation_between_markers_and_the_padding(qwen3, chats, capsys):
    from transformers import AutoTokenizer

    argv = [str(chats), "--tokenizer", str(qwen3), "--rows", "50", "--seq-len", "128"]
    assert main([*argv, "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    rows_text, summary = out.rstrip("\n").rsplit("\n", 1)
    blocks = re.split(r"^(?===)", rows_text, flags=re.M)
    assert not blocks[0] and len(blocks) == len(shown) + 1
    renderings = []
    for block, row in zip(blocks[1:], shown, strict=True):
        header, body = block.split("\n", 1)
        number, documents, used, padding, trained = map(int, ROW_HEADER.fullmatch(header).groups())
        assert (number, documents, padding) == (row["row"], len(row["documents"]), row["padding"])
        assert used == sum(len(d["ids"]) for d in row["documents"]) == 128 - padding
        assert trained == sum(sum(d["mask"]) for d in row["documents"])
        body, padding_line = body.rstrip("\n").rsplit("\n", 1)
        assert padding_line == f"[padding: {padding} token{'' if padding == 1 else 's'}]"
        _, *parts = MARKER.split(body + "\n")
        assert [int(n) for n in parts[0::3]] == list(range(1, documents + 1)) and not any(parts[1::3])
        renderings += parts[2::3]

    hf = AutoTokenizer.from_pretrained(str(qwen3))
    expected = [hf.apply_chat_template(r["messages"], tokenize=False) for r in CHATS]
    # Each conversation exactly once, its assistant turns (and only those) marked as trained.
    plain = [r.replace(TRAINED_OPEN, "").replace(TRAINED_CLOSE, "") for r in renderings]
    assert sorted(plain) == sorted(expected)
    for shown_text, text in zip(renderings, plain, strict=True):
        marked = re.findall(rf"{TRAINED_OPEN}(.*?){TRAINED_CLOSE}", shown_text, re.S)
        assert marked == [m.group(1) for m in ASSISTANT_TURN.finditer(text)]
    trained = sum(sum(d["mask"]) for row in shown for d in row["documents"])
    assert summary == (
        f"{len(shown)} rows of 128 positions: {trained} of {128 * len(shown)} positions trained "
        f"({trained / (128 * len(shown)):.1%}), {len(CHATS) / len(shown):.2f} documents per row; "
        f"one pass over the data gives only {len(shown)}"
    )


def test_terminal_rows_say_where_a_text_continues_from_the_row_before(texts, capsys):
    from qwen3_titan_common.data.tokens import DocumentTokenizer

    seq_len = 64
    assert main([str(texts), "--rows", "50", "--seq-len", str(seq_len), "--color", "never"]) == 0
    out = capsys.readouterr().out
    headers = ROW_HEADER.findall(out)
    # The stream of (input, label) pairs: a row boundary inside a document makes its rest a continued one.
    tokens = DocumentTokenizer(
        ChatTemplateTokenizer.Config().build(tokenizer_path=str(default_tokenizer_dir()))
    )
    lengths = [len(ids) - 1 for ids in tokens.documents(TEXTS)]
    starts = {sum(lengths[:k]) for k in range(len(lengths) + 1)}
    continued = [k + 1 for k in range(1, len(headers)) if k * seq_len not in starts]
    assert len(headers) == -(-sum(lengths) // seq_len) and continued  # every pair once, some rows continued
    assert [int(header[0]) for header in headers] == list(range(1, len(headers) + 1))
    continued_shown = re.findall(r"^== row (\d+).*\n\u2502doc 1, continued\u2502", out, re.M)
    assert [int(n) for n in continued_shown] == continued
    assert out.count(", continued") == len(continued)
    # The first row: the first text whole, its EOS trained and shown; only the last row is padded.
    first_row = out.split("\n", 2)[1]
    assert first_row.startswith(
        f"\u2502doc 1\u2502A{TRAINED_OPEN} short note.<|endoftext|>{TRAINED_CLOSE}\u2502doc 2\u2502"
    )
    assert re.findall(r"^\[padding: (\d+) tokens?\]$", out, re.M) == [headers[-1][3]]

    # One text to a row: a character of several bytes (several tokens) is shown once, as it is in the record.
    assert (
        main([str(texts), "--rows", "50", "--seq-len", str(seq_len), "--color", "never", "--no-packing"]) == 0
    )
    whole = f"\u2502doc 1\u2502C{TRAINED_OPEN}{TEXTS[2][1:]}<|endoftext|>{TRAINED_CLOSE}\n[padding: "
    assert whole in capsys.readouterr().out

    assert main([str(texts), "--rows", "1", "--seq-len", str(seq_len), "--color", "always"]) == 0
    assert f"{BOUNDARY_COLOR}\u2502doc 2\u2502{RESET}" in capsys.readouterr().out


def test_rows_stop_at_a_bad_record_as_training_does_or_skip_it(qwen3, data, capsys):
    argv = [str(data), "--tokenizer", str(qwen3), "--rows", "3", "--seq-len", "256", "--json"]
    assert main(argv) == 1  # record 2 stops training before a row of conversations is full
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and f"{data}:2: chat has no assistant turn" in captured.err

    assert main([*argv, "--on-bad-record", "skip"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    [(inputs, _, _)] = loader_rows(data, qwen3, 256, True, on_bad_record="skip")
    [row] = shown
    assert len(row["documents"]) == 2
    assert [t for d in row["documents"] for t in d["ids"]] == inputs[: 256 - row["padding"]]


@pytest.mark.parametrize(
    "flags",
    [
        ["--rows", "0", "--seq-len", "64"],
        ["--rows", "-2", "--seq-len", "64"],
        ["--rows", "2"],
        ["--rows", "2", "--seq-len", "64", "-n", "2"],
    ],
    ids=["zero", "negative", "no-seq-len", "with-n"],
)
def test_bad_rows_flags_are_one_line(texts, capsys, flags):
    assert main([str(texts), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("preview-data: ")
