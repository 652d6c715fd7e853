"""Documents into fixed-shape rows: every sample is exactly ``seq_len`` inputs, labels and positions.

Fixed shapes matter beyond tidiness: Neuron compiles one graph per input shape, so a single
short batch would cost a recompilation.

A document is a run of (input, label) pairs: a text's tokens and its EOS give pairs
``t[i] -> t[i+1]``, every label trained; a chat's rendering gives the same pairs with only the
assistant's tokens as labels. A document's EOS is a label, never an input, so the first token of
a document is never the label of the one before it. Inside a row, positions restart at 0 where
each document (or the part of one that the row holds) starts; the models read those restarts as
document boundaries and a token attends only to earlier tokens of its own document.

- Text is a stream (:class:`TextStreamPacker`): every row is filled to the last position, and a
  document longer than what is left of a row continues in the next one (as a new document there:
  it cannot attend to its own start in the previous row).
- Chats are packed whole (:class:`ChatPacker`): a conversation is never split; each row starts
  with the oldest conversation waiting and is filled, best fit first, from the few rows' worth
  of conversations read ahead, then padded.
- Without packing (:class:`OneDocumentPerRow`) each row holds one document, padded.

Padding is EOS inputs with ignored labels, positions counting up as one document of its own.

A preference pair (``data.preference``) is one document holding two sequences, its positions restarting
where the second starts, and the record it came from on every token (``records``; -1 elsewhere): packed
whole like a conversation, never split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torchtitan.components.loss import IGNORE_INDEX

from qwen3_titan_common.data.chat import ChatTokens
from qwen3_titan_common.data.records import InvalidRecord

# Conversations read ahead of the row being filled, in rows' worth of tokens: enough choice to fill
# rows almost to the last token (docs/performance.md), few enough that a checkpoint stays small.
CHAT_WINDOW_ROWS = 4

Row = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # inputs, labels, positions, records; (seq_len,)
NO_RECORD = -1


@dataclass(frozen=True)
class Document:
    inputs: np.ndarray
    labels: np.ndarray
    positions: np.ndarray | None = None
    """Per token; None: 0, 1, 2, ... (one sequence)."""
    records: np.ndarray | None = None
    """Per token, the dataset record it came from, for a preference pair; None: not recorded."""

    def __len__(self) -> int:
        return len(self.inputs)

    def position_ids(self) -> np.ndarray:
        return self.positions if self.positions is not None else np.arange(len(self.inputs), dtype=np.int64)

    def record_ids(self) -> np.ndarray:
        return (
            self.records if self.records is not None else np.full(len(self.inputs), NO_RECORD, dtype=np.int64)
        )

    def cut(self, start: int, stop: int | None = None) -> Document:
        """Tokens ``start:stop``; only a one-sequence document (text) is ever cut."""
        assert self.positions is None and self.records is None, "a pair is never cut"
        return Document(self.inputs[start:stop], self.labels[start:stop])

    def to_state(self) -> list[list[int]]:
        state = [self.inputs.tolist(), self.labels.tolist()]
        if self.positions is not None or self.records is not None:
            state += [self.position_ids().tolist(), self.record_ids().tolist()]
        return state

    @staticmethod
    def from_state(state: list[list[int]]) -> Document:
        arrays = [np.asarray(part, dtype=np.int64) for part in state]
        return Document(*arrays)


def text_document(ids: list[int], eos_id: int) -> Document | None:
    """A text's tokens (already ending in EOS) as pairs; None for a text of fewer than two tokens."""
    tokens = np.asarray(ids, dtype=np.int64)
    if tokens[-1] != eos_id:
        tokens = np.append(tokens, eos_id)
    if len(tokens) < 2:
        return None
    return Document(tokens[:-1], tokens[1:])


def chat_document(chat: ChatTokens, seq_len: int, eos_id: int) -> Document:
    """One conversation: labels are the next token where that token is an assistant token; one longer
    than a row is cut to the row (its trained tokens past the cut are lost)."""
    ids = np.asarray(chat.ids, dtype=np.int64)
    trained = np.asarray(chat.trained, dtype=bool)
    if ids[-1] != eos_id:
        # The EOS closes the document; predicting it is not trained: the assistant's own end-of-turn
        # token already is.
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
    return Document(inputs, labels)


def build_row(documents: list[Document], seq_len: int, pad_id: int) -> Row:
    """``documents`` side by side, positions restarting at each, padded to ``seq_len``."""
    used = sum(len(d) for d in documents)
    if used > seq_len:
        raise ValueError(f"{used} tokens do not fit a row of {seq_len}")
    parts = [*documents]
    if used < seq_len:
        missing = seq_len - used
        parts.append(
            Document(np.full(missing, pad_id, dtype=np.int64), np.full(missing, IGNORE_INDEX, dtype=np.int64))
        )
    inputs = np.concatenate([d.inputs for d in parts])
    labels = np.concatenate([d.labels for d in parts])
    positions = np.concatenate([d.position_ids() for d in parts])
    records = np.concatenate([d.record_ids() for d in parts])
    return inputs, labels, positions, records


def padding_row(seq_len: int, pad_id: int) -> Row:
    """A row that contributes nothing: EOS inputs, every label ignored."""
    return build_row([], seq_len, pad_id)


def document_starts(positions: np.ndarray) -> np.ndarray:
    """Indices where a document starts in a row (its position restarts at 0)."""
    return np.flatnonzero(np.asarray(positions) == 0)


class Packer:
    """Documents waiting for a row, and rows built but not yet dealt: what a checkpoint saves of a packer
    (its ``kind`` says which). Each subclass builds rows by its own rule (``rows``); the dataset takes them
    in groups (``take_rows``)."""

    kind = ""

    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.pending: list[Document] = []
        self.ready: list[Row] = []  # fewer than a group: they wait for the rest of theirs

    def add(self, document: Document) -> None:
        self.pending.append(document)

    def take_rows(self, count: int, final: bool = False) -> list[Row]:
        """The next ``count`` rows, or none while fewer can be built; with ``final`` (the end of a finite
        run) whatever is left, up to ``count``."""
        while len(self.ready) < count:
            row = next(self.rows(final), None)
            if row is None:
                break
            self.ready.append(row)
        if len(self.ready) < count and not (final and self.ready):
            return []
        taken, self.ready = self.ready[:count], self.ready[count:]
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "pending": [d.to_state() for d in self.pending],
            "ready": [[part.tolist() for part in row] for row in self.ready],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = [Document.from_state(d) for d in state["pending"]]
        self.ready = [_row_from_state(row) for row in state.get("ready", [])]


class TextStreamPacker(Packer):
    """Text documents as one stream cut into full rows; the first document waiting may be the rest of one
    that the last row cut."""

    kind = "text"

    def rows(self, final: bool = False):
        """Yields every full row; with ``final`` (the end of a finite run) also what is left, padded."""
        while sum(len(d) for d in self.pending) >= self.seq_len or (final and self.pending):
            room, parts = self.seq_len, []
            while self.pending and room:
                head = self.pending[0]
                if len(head) <= room:
                    parts.append(self.pending.pop(0))
                    room -= len(head)
                else:
                    parts.append(head.cut(0, room))
                    self.pending[0] = head.cut(room)
                    room = 0
            yield build_row(parts, self.seq_len, self.pad_id)


class ChatPacker(Packer):
    """Whole conversations, several to a row: the oldest waiting one first, then best fit.

    A row is built once ``CHAT_WINDOW_ROWS`` rows' worth of tokens wait (or at the end of a finite
    run): it takes the conversation waiting longest, so none waits for ever, then again and again the
    longest waiting conversation that still fits (the earliest of equal length). The result depends
    only on the order conversations arrive in, so it is the same in every run with the same seed.
    """

    kind = "chat"

    def __init__(self, seq_len: int, pad_id: int, window_rows: int = CHAT_WINDOW_ROWS):
        super().__init__(seq_len, pad_id)
        self.window = window_rows * seq_len

    def rows(self, final: bool = False):
        while self.pending and (final or sum(len(d) for d in self.pending) >= self.window):
            parts = [self.pending.pop(0)]
            room = self.seq_len - len(parts[0])
            while room:
                fits = [i for i, d in enumerate(self.pending) if len(d) <= room]
                if not fits:
                    break
                best = max(fits, key=lambda i: (len(self.pending[i]), -i))
                parts.append(self.pending.pop(best))
                room -= len(parts[-1])
            yield build_row(parts, self.seq_len, self.pad_id)


class OneDocumentPerRow(Packer):
    """``--dataloader.no-packing``: each row holds (part of) one document; a text longer than a row
    continues in rows of its own."""

    kind = "single"

    def rows(self, final: bool = False):
        while self.pending:
            head = self.pending.pop(0)
            if len(head) > self.seq_len:
                self.pending.insert(0, head.cut(self.seq_len))
                head = head.cut(0, self.seq_len)
            yield build_row([head], self.seq_len, self.pad_id)


def _row_from_state(row: list[list[int]]) -> Row:
    parts = [np.asarray(part, dtype=np.int64) for part in row]
    if len(parts) == 3:  # written before rows carried records
        parts.append(np.full(len(parts[0]), NO_RECORD, dtype=np.int64))
    return tuple(parts)  # type: ignore[return-value]


def make_packer(record_format: str, packing: bool, seq_len: int, pad_id: int) -> Packer:
    if not packing:
        return OneDocumentPerRow(seq_len, pad_id)
    if record_format in ("chat", "preference"):
        return ChatPacker(seq_len, pad_id)
    return TextStreamPacker(seq_len, pad_id)
