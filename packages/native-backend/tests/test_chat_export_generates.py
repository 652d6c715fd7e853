"""A chat-trained export, loaded with plain transformers, stops generating at the end of its turn.

The embedded default has no generation_config.json; the export writes one that stops at the chat
template's end of turn (``<|im_end|>``) as well as at EOS. Without it transformers stops only at
``<|endoftext|>``, which a chat-trained model never writes after its answer.
"""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TRAIN = str(Path(sys.executable).with_name("train"))
CPU_ENV = {**os.environ, "QWEN3_TITAN_DEVICE": "cpu", "QWEN3_TITAN_BACKEND": "native-backend"}
EXACT = ["--training.mixed_precision_param", "float32", "--debug.seed", "0", "--debug.deterministic"]
CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
# The tiny model answers "Hello there.<|im_end|>" after 12 steps; 20 leave a margin.
STEPS = 20
MAX_NEW_TOKENS = 40


def _generate(model, tokenizer, **kwargs) -> list[int]:
    prompt = tokenizer.apply_chat_template(
        [CHAT["messages"][0]], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, **kwargs)
    return out[0, prompt["input_ids"].shape[1] :].tolist()


@pytest.mark.slow
def test_a_chat_trained_export_stops_at_the_end_of_its_turn(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps(CHAT) + "\n") * 200)
    proc = subprocess.run(
        [TRAIN, "--dataloader.dataset", str(data), "--training.steps", str(STEPS), "--training.seq_len", "128",
         "--checkpoint.no-enable", "--validator.no-enable", "--dataloader.held_out", "0",
         "--dump_folder", str(tmp_path / "out"), *EXACT],
        cwd=tmp_path, env=CPU_ENV, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    export = tmp_path / "out" / "hf" / f"step-{STEPS}"

    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert model.generation_config.eos_token_id == [im_end, endoftext]
    assert tokenizer.model_max_length == model.config.max_position_embeddings

    answer = _generate(model, tokenizer)
    assert tokenizer.decode(answer) == "Hello there.<|im_end|>"
    assert answer[-1] == im_end and len(answer) < MAX_NEW_TOKENS

    # What transformers did without the generation config: EOS alone, and the model runs on past its turn.
    unstopped = _generate(model, tokenizer, eos_token_id=endoftext)
    assert len(unstopped) == MAX_NEW_TOKENS and unstopped[: len(answer)] == answer

    # The training run's files get the modes its umask gives new files, the weights included.
    probe = tmp_path / "probe"
    probe.touch()
    expected = stat.S_IMODE(probe.stat().st_mode)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in export.iterdir()}
    assert "model.safetensors" in modes and modes == dict.fromkeys(modes, expected)
