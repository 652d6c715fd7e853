"""The real `train` trains multi-turn Qwen3 chats (reasoning, tool calls) with the real Qwen3 tokenizer."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from qwen3_titan_common.data import ChatTemplateTokenizer, TextChatDataLoader
from qwen3_titan_common.perf.train_log import parse_step_lines
from qwen3_titan_testing.chats import sample_chat
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from qwen3_titan_testing.qwen3_tokenizer import QWEN3_VOCAB_SIZE, qwen3_tokenizer_dir
from torchtitan.components.loss import IGNORE_INDEX

TRAIN = str(Path(sys.executable).with_name("train"))
CPU_ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}


@pytest.mark.slow
def test_multi_turn_qwen3_chats_train_from_the_first_step(tmp_path):
    tokenizer = qwen3_tokenizer_dir(tmp_path / "tokenizer")
    model = make_tiny_checkpoint(tmp_path / "model", vocab_size=QWEN3_VOCAB_SIZE, tokenizer_dir=tokenizer)
    data = tmp_path / "chat.jsonl"
    records = [
        sample_chat(rounds, system=system, kind=kind)
        for rounds in (2, 3, 5)
        for system in (False, True)
        for kind in ("plain", "reasoning", "tools")
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = subprocess.run(
        [TRAIN, "--hf-model", str(model), "--dataloader.dataset", str(data), "--training.steps", "3",
         "--training.seq_len", "512", "--training.local_batch_size", "2", "--dataloader.earlier_reasoning", "split",
         "--checkpoint.no-enable", "--hf.no-export", "--validator.no-enable", "--dataloader.held_out", "0",
         "--dump_folder", str(tmp_path / "out")],
        cwd=tmp_path, env=CPU_ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "bad record" not in log and "skipped" not in log
    assert "data: loss on assistant turns between '<|im_start|>assistant\\n' and '<|im_end|>'" in log
    steps = parse_step_lines(log)
    assert [s.step for s in steps] == [1, 2, 3]
    # Random init predicts about uniformly over the 151,936-entry vocabulary.
    assert abs(steps[0].loss - math.log(QWEN3_VOCAB_SIZE)) < 0.3
    assert all(math.isfinite(s.loss) for s in steps)
    # The step line's trained share is the share of the step's rows whose label is not ignored.
    loader = TextChatDataLoader.Config(dataset=str(data), earlier_reasoning="split").build(
        dp_world_size=1,
        dp_rank=0,
        tokenizer=ChatTemplateTokenizer.Config().build(tokenizer_path=str(model)),
        seq_len=512,
        local_batch_size=2,
    )
    for step, (_, labels) in zip(steps, loader, strict=False):
        assert step.trained_percent == round(100 * int((labels != IGNORE_INDEX).sum()) / labels.numel())


@pytest.mark.slow
def test_the_configs_tokenizer_takes_a_generation_tag_template(tmp_path):
    # torchtitan's own HuggingFaceTokenizer cannot compile {% generation %}; the config composes ours.
    from qwen3_titan_native.config_registry import debug
    from transformers import AutoTokenizer

    template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' %}{% generation %}{{- m.content + '<|im_end|>' }}{% endgeneration %}"
        "{%- else %}{{- m.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    directory = qwen3_tokenizer_dir(tmp_path / "tokenizer", template)
    record = sample_chat(3, system=True, kind="plain")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(record) + "\n")
    config = debug()
    config.dataloader.dataset = str(data)
    tokenizer = config.tokenizer.build(tokenizer_path=str(directory))
    loader = config.dataloader.build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=256, local_batch_size=1
    )
    inputs, labels = next(iter(loader))
    reference = AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(
        record["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = reference["input_ids"], reference["assistant_masks"]
    assert inputs["input"][0, : len(ids)].tolist() == ids
    expected = [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)]
    assert labels[0, : len(ids) - 1].tolist() == expected
    hf = AutoTokenizer.from_pretrained(str(directory))
    assert (
        hf.decode([t for t in expected if t != -100])
        == "It is 1.<|im_end|>It is 3.<|im_end|>It is 5.<|im_end|>"
    )
