"""Per-document attention on every backend: a document packed with others scores as it does alone.

The rows come from the real dataloader (several texts, or several conversations rendered with the real
Qwen3 chat template, to a row); the models are each backend's own, built as ``eval`` builds them (the
trainer's model and attention), randomly initialised in fp32 on the CPU.
"""

import pytest
import torch
from qwen3_titan_common.arch.architecture import architecture_from_config
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.scripts.eval import eval_model_builder
from qwen3_titan_testing.checkpoints import tiny_qwen3_config
from qwen3_titan_testing.packed import (
    chat_records,
    documents_score_alone,
    packed_batch,
    text_records,
    write_jsonl,
)
from qwen3_titan_testing.qwen3_tokenizer import qwen3_tokenizer_dir

QWEN3_VOCAB = 151_936  # the published models' embedding rows (the tokenizer has 151,669 tokens)


def _builder(backend: str):
    """The model ``eval --backend`` builds (torchtitan's Qwen3 for native): the one each trainer trains."""
    return eval_model_builder(None if backend == "native" else f"{backend}-backend")[0]


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """Two packed rows of each kind, with the vocabulary and row length they need (read once)."""
    root = tmp_path_factory.mktemp("packed")
    text = write_jsonl(root / "text.jsonl", text_records())
    chat = write_jsonl(root / "chat.jsonl", chat_records())
    return {
        "text": (4096, 256, packed_batch(text, default_tokenizer_dir(), seq_len=256, rows=2)),
        "chat": (
            QWEN3_VOCAB,
            512,
            packed_batch(chat, qwen3_tokenizer_dir(root / "qwen3"), seq_len=512, rows=2),
        ),
    }


@pytest.mark.parametrize("data", ["text", "chat"])
@pytest.mark.parametrize(
    "backend,moe", [("native", False), ("hf-v5", False), ("hf-v5", True), ("nki-moe", True)]
)
def test_each_document_has_the_logits_it_has_alone(batches, backend, moe, data):
    vocab, seq_len, (tokens, positions, _) = batches[data]
    arch = architecture_from_config(tiny_qwen3_config(moe=moe, vocab_size=vocab).to_dict())
    torch.manual_seed(0)
    model = _builder(backend)(arch, None, dtype=torch.float32, seq_len=seq_len, seed=0)
    assert documents_score_alone(model, tokens, positions) >= 4
