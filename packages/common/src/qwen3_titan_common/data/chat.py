"""Chat records rendered with the tokenizer's own chat template, assistant tokens marked.

Which tokens an assistant turn contributes is found in characters, then mapped to tokens:

- the turn starts where the template's generation prompt for it ends
  (``render(messages[:i], add_generation_prompt=True)``, e.g. after ``<|im_start|>assistant\\n``):
  the prompt header is what inference supplies, so it is not trained;
- it ends where ``render(messages[:i+1])`` ends, less trailing whitespace: the end-of-turn token
  (``<|im_end|>``) is trained, so the model learns to stop; the newline the template writes after
  it is not, since generation stops before it.

The whole conversation is tokenized once, as inference would tokenize it, and a token is an
assistant token when its first character lies inside an assistant turn. That needs a template
that renders a conversation's prefix as a prefix of the full rendering (ChatML and Qwen3's do);
otherwise the record is reported as bad.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from qwen3_titan_common.data.records import InvalidRecord
from qwen3_titan_common.data.sources import DatasetError
from qwen3_titan_common.data.tokens import DocumentTokenizer

_PROBE = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


@dataclass(frozen=True)
class ChatTokens:
    ids: list[int]
    trained: list[bool]  # per token: written by an assistant turn, so predicting it is trained


class ChatTokenizer:
    def __init__(self, tokens: DocumentTokenizer):
        self.tokens = tokens
        # Templates written for transformers may use these (e.g. Llama's `{{ bos_token }}`).
        self._template_vars = {
            name: getattr(tokens.base, name)
            for name in ("bos_token", "eos_token")
            if getattr(tokens.base, name, None)
        }
        try:
            probe = self.tokenize(_PROBE)
        except ValueError as e:  # torchtitan: "No chat template set"
            raise DatasetError(
                f"chat records need a chat template: the tokenizer has none ({e}); add `chat_template` to "
                "tokenizer_config.json or a chat_template.jinja next to it"
            ) from e
        except InvalidRecord as e:
            raise DatasetError(
                f"the tokenizer's chat template cannot be used for assistant-only loss: {e}"
            ) from e
        if not any(probe.trained):
            raise DatasetError(
                "the tokenizer's chat template writes no assistant text; nothing would be trained"
            )

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.tokens.base.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **self._template_vars
            )
        except jinja2.TemplateError as e:
            raise InvalidRecord(f"chat template rejected the conversation ({e})") from e

    def assistant_spans(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant turn in it."""
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise InvalidRecord(
                    f"the chat template renders turn {i} differently once other turns follow, "
                    "so its assistant tokens cannot be located"
                )
            start = len(before)
            spans.append((start, start + len(through[start:].rstrip())))
        return full, spans

    def tokenize(self, messages: list[dict[str, Any]]) -> ChatTokens:
        text, spans = self.assistant_spans(messages)
        ids, offsets = self.tokens.with_offsets(text)
        starts = [s for s, _ in spans]
        trained = []
        for first_char, _ in offsets:
            turn = bisect.bisect_right(starts, first_char) - 1
            trained.append(turn >= 0 and first_char < spans[turn][1])
        return ChatTokens(ids=ids, trained=trained)
