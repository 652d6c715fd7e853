"""``preview-data``: the first records of a dataset, which tokens carry loss, before a run is paid for.

Checked against what the real dataloader trains and against transformers' own rendering and offsets.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.cli.preview_data import TRAINED_CLOSE, TRAINED_OPEN, main
from qwen3_titan_common.data import ChatTemplateTokenizer, TextChatDataLoader
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
