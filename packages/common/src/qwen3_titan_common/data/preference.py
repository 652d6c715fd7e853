"""Preference records (TRL's formats) as the pair of sequences one DPO comparison reads.

Two shapes, as TRL's DPOTrainer reads them:

- explicit prompt: ``{"prompt": ..., "chosen": ..., "rejected": ...}``;
- implicit prompt: ``{"chosen": ..., "rejected": ...}``, two whole conversations whose shared beginning is
  the prompt (for message lists, the longest common run of messages; for strings, the longest common run
  of characters).

Each field is a string, or a list of ``{role, content}`` messages (a completion is then the assistant's
turn or turns). Strings are tokenized by TRL's rule: the prompt, and the prompt followed by the completion,
each as a whole text (as inference reads it), then EOS; the completion starts where the two token sequences
stop agreeing (a token merged across the boundary belongs to the completion), and it and the EOS are
trained. Messages are rendered whole with the model's own chat template (``data.chat``): prompt and
completion together, as inference would see them, and the completion's assistant turns are what is
trained, as in chat fine-tuning (thinking and tool calls included).

A pair becomes one :class:`~qwen3_titan_common.data.packing.Document`, with the record's index in the dataset
on every token (the reference log-probabilities are looked up by it, ``components.preference``). The packers
never split a document across rows, so a pair is always whole in one row and on one rank. Two layouts:

- prompt shared (``share_prompt``): the prompt and the chosen completion, then the rejected completion as a
  continuation of the prompt: its positions go on from the prompt's, and it attends to the prompt and to
  itself only (``models.document_blocks``). It starts with the prompt's last token again, whose next token
  is the rejected completion's first. The prompt is computed once, and each completion's tokens get the same
  log-probabilities as in a sequence of its own;
- repeated: the chosen sequence, then the rejected one, each with its own positions from 0 and its own copy
  of the prompt, for attention that knows documents only (Flex and varlen on CUDA, transformers' SDPA mask).
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass
from typing import Any

import numpy as np
from torchtitan.components.loss import IGNORE_INDEX

from qwen3_titan_common.data.chat import ChatTokenizer, EarlierReasoning, overlapping
from qwen3_titan_common.data.conversation import conversation_of, reasoning_of
from qwen3_titan_common.data.packing import Document
from qwen3_titan_common.data.records import InvalidRecord, check_unicode, kind_of
from qwen3_titan_common.data.sources import DatasetError
from qwen3_titan_common.data.tokens import DocumentTokenizer

PROMPT, CHOSEN, REJECTED = "prompt", "chosen", "rejected"


@dataclass(frozen=True)
class Sequence:
    """One side of a pair: its token ids and, per token, whether predicting it is trained."""

    ids: np.ndarray
    trained: np.ndarray

    def document(self, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) as a row holds them: the next token where it is trained."""
        ids, trained = self.ids, self.trained
        if ids[-1] != eos_id:
            ids, trained = np.append(ids, eos_id), np.append(trained, False)
        return ids[:-1], np.where(trained[1:], ids[1:], IGNORE_INDEX)


@dataclass(frozen=True)
class Pair:
    chosen: Sequence
    rejected: Sequence

    @property
    def identical(self) -> bool:
        """Chosen and rejected are the same tokens: the pair's DPO term has no gradient (no signal)."""
        return np.array_equal(self.chosen.ids, self.rejected.ids)

    @property
    def shared_prompt(self) -> int:
        """Tokens both sequences begin with before either's first trained token (at least 1: the prompt's)."""
        chosen, rejected = self.chosen, self.rejected
        limit = min(int(np.argmax(chosen.trained)), int(np.argmax(rejected.trained)))
        same = chosen.ids[:limit] == rejected.ids[:limit]
        return int(np.argmin(same)) if not same.all() else limit

    def lengths(self, eos_id: int, share_prompt: bool) -> tuple[int, int]:
        """The tokens the chosen and the rejected sequence take in a row (inputs: an EOS appended where a
        sequence does not end with one, its last token a label only; the rejected from the shared prompt's last
        token on when it is shared)."""
        chosen, rejected = (len(side.document(eos_id)[0]) for side in (self.chosen, self.rejected))
        if share_prompt:
            rejected -= max(self.shared_prompt - 1, 0)
        return chosen, rejected

    def document(self, eos_id: int, record: int, share_prompt: bool = False) -> Document:
        """Both sequences side by side (module docstring), ``record`` on every token."""
        (chosen_in, chosen_labels), (rejected_in, rejected_labels) = (
            self.chosen.document(eos_id),
            self.rejected.document(eos_id),
        )
        # Nothing shared (prompts that tokenize apart): the rejected sequence restarts, a document of its own.
        first = max(self.shared_prompt - 1, 0) if share_prompt else 0
        inputs = np.concatenate([chosen_in, rejected_in[first:]])
        return Document(
            inputs,
            np.concatenate([chosen_labels, rejected_labels[first:]]),
            positions=np.concatenate(
                [
                    np.arange(len(chosen_in), dtype=np.int64),
                    np.arange(first, len(rejected_in), dtype=np.int64),
                ]
            ),
            records=np.full(len(inputs), record, dtype=np.int64),
        )


def pair_markers(labels: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """A row's labels ignored but at one token per pair: the first trained token of its chosen sequence.

    In a row of pairs the sequences with trained tokens come chosen, rejected, chosen, ...; each starts where
    its positions do not go on from the token before (a restart at 0, or a continuation of the prompt)."""
    markers = np.full_like(labels, IGNORE_INDEX)
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    if not len(trained):
        return markers
    positions = np.asarray(positions)
    starts = np.r_[True, positions[1:] != positions[:-1] + 1]
    sequence = np.cumsum(starts)[trained]
    firsts = trained[np.r_[True, sequence[1:] != sequence[:-1]]]
    chosen = firsts[0::2]
    markers[chosen] = labels[chosen]
    return markers


class PreferenceTokenizer:
    """Preference records into :class:`Pair` s; message lists need the tokenizer's chat template."""

    def __init__(self, tokens: DocumentTokenizer, chat: ChatTokenizer | None, share_prompt: bool = False):
        self.tokens = tokens
        self.chat = chat
        self.share_prompt = share_prompt

    @classmethod
    def of(cls, tokens: DocumentTokenizer, earlier_reasoning: EarlierReasoning, share_prompt: bool = False):
        """With the tokenizer's chat template where it has one: string pairs need none, and message pairs say
        so record by record."""
        try:
            chat = ChatTokenizer(tokens, earlier_reasoning)
        except DatasetError:
            chat = None
        return cls(tokens, chat, share_prompt)

    def pair(self, record: Any, seq_len: int) -> Pair:
        """The record's pair; raises InvalidRecord naming the field at fault."""
        if not isinstance(record, dict):
            raise InvalidRecord(
                f"record is {kind_of(record)} (expected an object with fields 'chosen', 'rejected')"
            )
        for name in (CHOSEN, REJECTED):
            if name not in record:
                raise InvalidRecord(f"field '{name}' missing (expected a string or a list of messages)")
        prompt, chosen, rejected = record.get(PROMPT), record[CHOSEN], record[REJECTED]
        given = [v for v in (prompt, chosen, rejected) if v is not None]
        messages = [isinstance(v, list | tuple) for v in given]
        if any(messages) and not all(messages):
            raise InvalidRecord(
                "fields 'prompt', 'chosen' and 'rejected' mix strings and message lists (expected all strings or "
                "all lists of messages)"
            )
        if any(messages):
            pair = self._message_pair(prompt, chosen, rejected, tools=record.get("tools"))
        else:
            pair = self._string_pair(prompt, chosen, rejected)
        for name, side in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
            if not side.trained[1:].any():
                raise InvalidRecord(
                    f"field '{name}': the chat template marks none of its completion's tokens as the assistant's "
                    "(nothing to compare)"
                )
        chosen, rejected = pair.lengths(self.tokens.eos_id, self.share_prompt)
        if chosen + rejected > seq_len:
            what = "the rejected completion after the shared prompt" if self.share_prompt else "rejected"
            raise InvalidRecord(
                f"the pair is {chosen + rejected} tokens (chosen {chosen} + {what} {rejected}), longer than a row "
                f"(--training.seq_len {seq_len}); a pair is never split, so raise seq_len or shorten it"
            )
        return pair

    # -- strings -----------------------------------------------------------------------------

    def _string_pair(self, prompt: Any, chosen: Any, rejected: Any) -> Pair:
        for name, value in ((CHOSEN, chosen), (REJECTED, rejected), (PROMPT, prompt)):
            if value is None and name == PROMPT:
                continue
            if not isinstance(value, str):
                raise InvalidRecord(f"field '{name}' is {kind_of(value)} (expected a string)")
            check_unicode(value, f"field '{name}'")
            self.tokens.check_plain(value, f"field '{name}'")
        if prompt is None:
            prompt, chosen, rejected = _split_common_text(chosen, rejected)
        for name, value in ((CHOSEN, chosen), (REJECTED, rejected)):
            if not value.strip():
                raise InvalidRecord(
                    f"field '{name}' is an empty completion (expected some text after the prompt)"
                )
        if not prompt.strip():
            raise InvalidRecord("field 'prompt' is empty (expected the text both completions answer)")
        prompt_ids, chosen_ids, rejected_ids = self._encode([prompt, prompt + chosen, prompt + rejected])
        start = min(_common_length(prompt_ids, chosen_ids), _common_length(prompt_ids, rejected_ids))
        return Pair(self._string_sequence(chosen_ids, start), self._string_sequence(rejected_ids, start))

    def _encode(self, texts: list[str]) -> list[list[int]]:
        fast = self.tokens.fast
        if fast is None:
            return [self.tokens.base.encode(t, add_bos=False, add_eos=False) for t in texts]
        return [e.ids for e in fast.encode_batch(texts, add_special_tokens=False)]

    def _string_sequence(self, ids: list[int], start: int) -> Sequence:
        """The prompt and completion's tokens and EOS, trained from ``start`` (where the completion starts)."""
        tokens = np.asarray([*ids, self.tokens.eos_id], dtype=np.int64)
        trained = np.zeros(len(tokens), dtype=bool)
        trained[start:] = True
        return Sequence(tokens, trained)

    # -- message lists -----------------------------------------------------------------------

    def _message_pair(self, prompt: Any, chosen: Any, rejected: Any, tools: Any) -> Pair:
        if self.chat is None:
            raise InvalidRecord("message lists need the tokenizer's chat template, and it has none")
        if prompt is None:
            prompt, chosen, rejected = _split_common_messages(chosen, rejected)
        prompt_messages = self._messages(prompt, PROMPT) if prompt else []
        if not prompt_messages:
            raise InvalidRecord("field 'prompt' is empty (expected the messages both completions answer)")
        if prompt_messages[-1]["role"] == "assistant":
            raise InvalidRecord(
                f"field 'prompt' ends with an assistant turn (prompt[{len(prompt_messages) - 1}]); the completions "
                "are the assistant's answer, so the prompt ends with the turn they answer"
            )
        return Pair(
            self._message_sequence(prompt_messages, chosen, CHOSEN, tools),
            self._message_sequence(prompt_messages, rejected, REJECTED, tools),
        )

    @staticmethod
    def _messages(value: Any, name: str) -> list[dict[str, Any]]:
        if not isinstance(value, list | tuple):
            raise InvalidRecord(f"field '{name}' is {kind_of(value)} (expected a list of messages)")
        if not value:
            return []
        # conversation_of checks each message (naming it name[i]); a prompt has no assistant turn to require.
        record = {name: [*value, {"role": "assistant", "content": "x"}]}
        return conversation_of(record, name, "tools").messages[:-1]

    def _message_sequence(self, prompt: list[dict], completion: Any, name: str, tools: Any) -> Sequence:
        assert self.chat is not None
        if not isinstance(completion, list | tuple) or not completion:
            raise InvalidRecord(f"field '{name}' is an empty completion (expected the assistant's messages)")
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
            roles = ", ".join(str(m.get("role")) if isinstance(m, dict) else kind_of(m) for m in completion)
            raise InvalidRecord(f"field '{name}' has no assistant turn (roles: {roles}); nothing to compare")
        try:
            conversation = conversation_of(
                {"messages": [*prompt, *completion], "tools": tools}, "messages", "tools"
            )
        except InvalidRecord as err:
            raise InvalidRecord(f"field '{name}' (after the prompt): {err}") from None
        answers = [m for m in conversation.messages[len(prompt) :] if m["role"] == "assistant"]
        if not any(a["content"].strip() or a.get("tool_calls") or reasoning_of(a) for a in answers):
            raise InvalidRecord(f"field '{name}' is an empty completion (the assistant's turn is empty)")
        self.chat.check(conversation, name)
        text, spans = self.chat.turns(conversation)
        assistants = conversation.assistant_indices()
        if len(spans) != len(assistants):
            raise InvalidRecord(
                f"the chat template marks {len(spans)} assistant span(s) for {len(assistants)} assistant "
                "message(s); a preference pair needs one each to find its completion"
            )
        kept = [span for i, span in zip(assistants, spans, strict=True) if i >= len(prompt)]
        ids, offsets = self.tokens.with_offsets(text)
        return Sequence(np.asarray(ids, dtype=np.int64), overlapping(offsets, kept))


def _common_length(a: abc.Sequence[Any], b: abc.Sequence[Any]) -> int:
    """How many leading items ``a`` and ``b`` share (token ids, characters, messages)."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _split_common_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """An implicit prompt in strings: the longest common beginning of the two texts, ended before a space
    that starts the completions (TRL's rule: the space belongs to the completion)."""
    common = _common_length(chosen, rejected)
    if common == len(chosen) or common == len(rejected):
        raise InvalidRecord(
            "fields 'chosen' and 'rejected' have no implicit prompt: one is the start of the other (expected two "
            "conversations that share a beginning and then differ; or give a 'prompt' field)"
        )
    if common and chosen[common - 1] == " ":
        common -= 1
    if common == 0:
        raise InvalidRecord(
            "fields 'chosen' and 'rejected' share no beginning, so there is no implicit prompt (give a 'prompt' "
            "field, or conversations that start the same)"
        )
    return chosen[:common], chosen[common:], rejected[common:]


def _split_common_messages(chosen: Any, rejected: Any) -> tuple[list, list, list]:
    """An implicit prompt in messages: the longest common run of whole messages."""
    for name, value in ((CHOSEN, chosen), (REJECTED, rejected)):
        if not isinstance(value, list | tuple) or not value:
            raise InvalidRecord(f"field '{name}' is {kind_of(value)} (expected a non-empty list of messages)")
    common = _common_length(chosen, rejected)
    # Each side keeps at least its last message as its completion (identical conversations: an identical pair).
    common = min(common, len(chosen) - 1, len(rejected) - 1)
    if common == 0:
        raise InvalidRecord(
            "fields 'chosen' and 'rejected' share no first message, so there is no implicit prompt (give a "
            "'prompt' field, or conversations that start the same)"
        )
    return list(chosen[:common]), list(chosen[common:]), list(rejected[common:])
