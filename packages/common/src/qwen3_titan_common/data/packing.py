"""Token ids into fixed-shape rows: every sample is exactly ``seq_len`` inputs and ``seq_len`` labels.

Fixed shapes matter beyond tidiness: Neuron compiles one graph per input shape, so a single
short batch would cost a recompilation.

- Plain text is packed: documents (each ending in EOS) form one stream, cut into rows of
  ``seq_len`` inputs whose labels are the stream shifted by one. Consecutive rows share one
  token, so no token is dropped and no padding is needed.
- A chat is one row of its own, truncated or padded with EOS (padded labels ignored): with the
  SDPA attention our backends use, tokens of a packed row would attend across conversations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torchtitan.components.loss import IGNORE_INDEX

from qwen3_titan_common.data.chat import ChatTokens
from qwen3_titan_common.data.records import InvalidRecord


class TokenPacker:
    """The text stream not yet emitted; its first token is the last label of the previous row."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.pending: list[int] = []

    def add(self, document_ids: list[int]) -> None:
        self.pending.extend(document_ids)

    def next_row(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Inputs and labels of the next full row, or None until enough tokens are pending."""
        if len(self.pending) <= self.seq_len:
            return None
        row = np.asarray(self.pending[: self.seq_len + 1], dtype=np.int64)
        del self.pending[: self.seq_len]
        return row[:-1], row[1:]

    def last_row(self, pad_id: int) -> tuple[np.ndarray, np.ndarray] | None:
        """What is left at the end of a finite run, padded to a full row (padding not trained)."""
        if len(self.pending) < 2:
            self.pending = []
            return None
        row = np.asarray(self.pending, dtype=np.int64)
        self.pending = []
        return _pad(row[:-1], row[1:], self.seq_len, pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"pending": list(self.pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = list(state["pending"])


def _pad(inputs: np.ndarray, labels: np.ndarray, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    missing = seq_len - len(inputs)
    return (
        np.concatenate([inputs, np.full(missing, pad_id, dtype=np.int64)]),
        np.concatenate([labels, np.full(missing, IGNORE_INDEX, dtype=np.int64)]),
    )


def chat_row(chat: ChatTokens, seq_len: int, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One conversation as one row: labels are the next token where that token is an assistant token."""
    ids = np.asarray(chat.ids, dtype=np.int64)
    trained = np.asarray(chat.trained, dtype=bool)
    if ids[-1] != eos_id:
        # The EOS closes the document (as between packed texts); predicting it is not trained:
        # the assistant's own end-of-turn token already is.
        ids = np.append(ids, eos_id)
        trained = np.append(trained, False)
    inputs = ids[:-1][:seq_len]
    labels = np.where(trained[1:], ids[1:], IGNORE_INDEX)[:seq_len]
    if not (labels != IGNORE_INDEX).any():
        first = int(np.argmax(trained)) if trained.any() else len(ids)
        raise InvalidRecord(
            f"assistant text starts at token {first}, beyond --training.seq_len {seq_len}; "
            "raise seq_len or shorten the conversation"
        )
    return _pad(inputs, labels, seq_len, eos_id)


def positions_restarting_after_eos(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """Position of each input within its document: 0 at the row start and after every EOS.

    Restarting at the row start too keeps positions below ``seq_len`` (inside the RoPE table)
    however long a document is; torchtitan's Flex/varlen attention reads these restarts as
    document boundaries and masks attention across them.
    """
    starts = np.concatenate([[True], inputs[:-1] == eos_id])
    start_index = np.flatnonzero(starts)
    document = np.cumsum(starts) - 1
    return np.arange(len(inputs), dtype=np.int64) - start_index[document]
