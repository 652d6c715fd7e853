"""Packed rows from the real dataloader, and the check every backend's model must pass on them.

A packed row holds several documents, positions restarting at 0 where each starts. Per-document attention
means each document's logits in the row are the logits it has run alone (its own tokens, positions from 0):
nothing of its neighbours reaches it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qwen3_titan_testing.chats import sample_chat

# fp32 logits of a tiny model: a document computed inside a packed row and alone runs the same products,
# only the attention kernels' blocking (and the masked entries, exact zeros) differ: rounding of a few ulps
# of values of order 1, far below 1e-5.
ATOL = 1e-5


def chat_records() -> list[dict]:
    """Conversations of every shape the tests know (reasoning, tool calls, a system turn), 1-3 rounds."""
    return [
        sample_chat(rounds, system=system, kind=kind)
        for rounds in (1, 2, 3)
        for kind in ("plain", "reasoning", "tools")
        for system in (False, True)
    ]


def text_records(n: int = 40) -> list[dict]:
    return [{"text": f"Document {i}: " + "the quick brown fox jumps. " * (1 + i % 9)} for i in range(n)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def packed_batch(dataset: Path, tokenizer_dir: Path, *, seq_len: int, rows: int):
    """The first ``rows`` rows the training dataloader packs from ``dataset``: tokens, positions, labels."""
    from qwen3_titan_common.data import ChatTemplateTokenizer, TextChatDataLoader

    tokenizer = ChatTemplateTokenizer.Config().build(tokenizer_path=str(tokenizer_dir))
    loader = TextChatDataLoader.Config(dataset=str(dataset), shuffle=False).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=rows
    )
    inputs, labels = next(iter(loader))
    return inputs["input"], inputs["positions"], labels


def segments(positions_L: torch.Tensor) -> list[tuple[int, int]]:
    from qwen3_titan_common.data.packing import document_starts

    starts = document_starts(positions_L.numpy()).tolist() + [len(positions_L)]
    return list(zip(starts, starts[1:], strict=False))


def documents_score_alone(model: torch.nn.Module, tokens_BL: torch.Tensor, positions_BL: torch.Tensor) -> int:
    """Asserts that every document of every row has the logits it has alone; returns how many were checked.

    ``model(tokens, positions)`` is a backend's model as ``eval`` builds it. Also asserts that the rows do
    hold several documents, and that without positions (one causal sequence per row) the logits differ:
    the check can fail.
    """
    with torch.no_grad():
        packed_BLV = model(tokens_BL, positions_BL)
        unmasked_BLV = model(tokens_BL)
        checked = crossed = 0
        for row in range(tokens_BL.shape[0]):
            parts = segments(positions_BL[row])
            assert len(parts) > 1, f"row {row} holds one document: nothing to check"
            for start, end in parts:
                alone_LV = model(tokens_BL[row : row + 1, start:end], positions_BL[row : row + 1, start:end])[
                    0
                ]
                difference = (packed_BLV[row, start:end] - alone_LV).abs().max().item()
                assert difference <= ATOL, f"row {row}, document at {start}-{end}: off by {difference:.3g}"
                checked += 1
                if start > 0:
                    crossed += (unmasked_BLV[row, start:end] - alone_LV).abs().max().item() > 100 * ATOL
    assert crossed, "attending across documents changed nothing: the check cannot tell the two apart"
    return checked
