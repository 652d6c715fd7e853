"""Chat records rendered with the tokenizer's own chat template, assistant tokens marked.

The conversation is rendered once, as a whole, and tokenized once, as inference would see it. Each
assistant turn is located in that rendering (``turns``): from the end of its role header up to and
including its end-of-turn token; a template with ``{% generation %}`` blocks says itself what is the
assistant's. A token is trained when its characters overlap an assistant span, the rule transformers'
``return_assistant_tokens_mask`` applies.

Earlier reasoning: Qwen3's hybrid template renders an assistant's reasoning only for turns after the
last user message; earlier turns appear without it. ``earlier_reasoning`` says what to do with a turn
whose reasoning the full rendering leaves out:

- ``template`` (default, the template's own behaviour): train the turn as rendered, without it;
- ``context``: do not train that turn (it stays in the conversation as context);
- ``split``: train it in a row of its own, the conversation cut after it, where the template renders
  it with its reasoning (as the last turn); the full conversation's row trains the other turns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import numpy as np

from qwen3_titan_common.data.conversation import Conversation, reasoning_of
from qwen3_titan_common.data.records import InvalidRecord
from qwen3_titan_common.data.sources import DatasetError
from qwen3_titan_common.data.template import ChatRenderer, template_source
from qwen3_titan_common.data.tokens import DocumentTokenizer
from qwen3_titan_common.data.turns import TurnMarkers

EarlierReasoning = Literal["template", "context", "split"]
_PROBE = Conversation([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])
# A tool call and a tool definition with names no template writes by itself: whether a rendering holds
# them says whether the template writes tool calls and tool definitions at all.
_PROBE_CALL = "qwen3_titan_probe_call"
_PROBE_TOOL = "qwen3_titan_probe_tool"
_TOOL_PROBE = Conversation(
    [
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": _PROBE_CALL, "arguments": {}}}],
        },
    ],
    tools=[{"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {"type": "object"}}}],
)


@dataclass(frozen=True)
class ChatTokens:
    ids: list[int]
    trained: np.ndarray  # bool per token: written by an assistant turn, so predicting it is trained
    text: str  # the rendered conversation
    offsets: list[tuple[int, int]]  # each token's characters in it


class ChatTokenizer:
    def __init__(self, tokens: DocumentTokenizer, earlier_reasoning: EarlierReasoning = "template"):
        import jinja2

        self.tokens = tokens
        self.earlier_reasoning = earlier_reasoning
        source = template_source(tokens.base)
        if source is None:
            raise DatasetError(
                "chat records need a chat template: the tokenizer has none; add `chat_template` to "
                "tokenizer_config.json or a chat_template.jinja next to it"
            )
        # Templates written for transformers may use these (e.g. Llama's `{{ bos_token }}`).
        variables = {
            name: getattr(tokens.base, name)
            for name in ("bos_token", "eos_token")
            if getattr(tokens.base, name, None)
        }
        self.renderer = ChatRenderer(source, variables)
        try:
            self.markers = None if self.renderer.has_generation_tags else TurnMarkers.probe(self.renderer)
            probe = self.tokenize(_PROBE)
        except jinja2.TemplateError as e:
            raise DatasetError(f"the tokenizer's chat template fails on a two-message chat ({e})") from e
        except InvalidRecord as e:
            raise DatasetError(
                f"the tokenizer's chat template cannot be used for assistant-only loss: {e}"
            ) from e
        if not probe[0].trained.any():
            raise DatasetError(
                "the tokenizer's chat template writes no assistant text; nothing would be trained"
            )
        try:
            written = self.renderer.render(_TOOL_PROBE.messages, tools=_TOOL_PROBE.tools).text
        except jinja2.TemplateError:
            written = ""
        self.writes_tool_calls = _PROBE_CALL in written
        self.writes_tools = _PROBE_TOOL in written

    @property
    def method(self) -> str:
        """How assistant tokens are found, for the log and ``preview-data``."""
        if self.markers is None:
            return "the template's {% generation %} blocks"
        return f"assistant turns between {self.markers.header!r} and {self.markers.end!r}"

    def turns(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans trained in it, in order."""
        import jinja2

        try:
            rendering = self.renderer.render(conversation.messages, tools=conversation.tools)
        except jinja2.TemplateError as e:
            raise InvalidRecord(f"chat template rejected the conversation ({e})") from e
        if self.markers is None:
            return rendering.text, rendering.generation_spans
        return rendering.text, self.markers.locate(rendering.text, conversation)

    def check(self, conversation: Conversation, messages_field: str = "messages") -> None:
        """What the template would silently drop or the tokenizer misread, refused: tool calls or tool
        definitions a template without tool support leaves out, and special-token text in any field."""
        calls = [i for i, m in enumerate(conversation.messages) if m.get("tool_calls")]
        if calls and not self.writes_tool_calls:
            raise InvalidRecord(
                f"{messages_field}[{calls[0]}] has tool_calls, and the tokenizer's chat template does not write "
                "tool calls (they would be dropped from the text trained); use a template with tool support, "
                "or leave them out of the data"
            )
        if conversation.tools and not self.writes_tools:
            raise InvalidRecord(
                "the record has tool definitions, and the tokenizer's chat template does not write them (they "
                "would be dropped from the text trained); use a template with tool support, or leave them out"
            )
        if conversation.tools:
            # Written into the system turn as JSON.
            self.tokens.check_plain(json.dumps(conversation.tools, ensure_ascii=False), "field 'tools'")
        for i, message in enumerate(conversation.messages):
            for key, value in message.items():
                if isinstance(value, str):
                    self.tokens.check_plain(value, f"{messages_field}[{i}]: field '{key}'")
            for j, call in enumerate(message.get("tool_calls") or ()):
                # Written as the template writes it: the name and the arguments, a string or an object.
                written = json.dumps(call.get("function", call), ensure_ascii=False)
                self.tokens.check_plain(written, f"{messages_field}[{i}].tool_calls[{j}]")

    def tokenize(self, conversation: Conversation) -> list[ChatTokens]:
        """The rows one conversation trains: one, or with ``split`` one more per turn cut out. An assistant
        message with OpenAI fine-tuning's ``"weight": 0`` stays in the conversation as context, untrained."""
        text, spans = self.turns(conversation)
        untrained = weighted_out(conversation)
        assistants = conversation.assistant_indices()
        if (untrained or self.earlier_reasoning != "template") and len(spans) != len(assistants):
            why = (
                f"--dataloader.earlier_reasoning {self.earlier_reasoning}"
                if self.earlier_reasoning != "template"
                else f'messages[{min(untrained)}]\'s "weight": 0'
            )
            raise InvalidRecord(
                f"the chat template marks {len(spans)} {{% generation %}} block(s) for {len(assistants)} "
                f"assistant message(s); {why} needs one each"
            )
        if untrained and all(i in untrained for i in assistants):
            raise InvalidRecord('every assistant message has "weight": 0; nothing to train')
        if self.earlier_reasoning == "template":
            if untrained:
                spans = [span for i, span in zip(assistants, spans, strict=True) if i not in untrained]
            return [self._tokens(text, spans)]
        kept, rows = [], []
        for i, span in zip(assistants, spans, strict=True):
            if i in untrained:
                continue
            reasoning = reasoning_of(conversation.messages[i])
            if not reasoning or reasoning in text[span[0] : span[1]]:
                kept.append(span)
            elif self.earlier_reasoning == "split":
                cut = Conversation(conversation.messages[: i + 1], conversation.tools)
                cut_text, cut_spans = self.turns(cut)
                last = cut_spans[-1]
                if reasoning in cut_text[last[0] : last[1]]:
                    rows.append(self._tokens(cut_text, [last]))
                else:  # the template never renders it: train the turn as it renders it
                    kept.append(span)
        if kept:
            rows.append(self._tokens(text, kept))
        if not rows:
            raise InvalidRecord(
                "every assistant turn's reasoning is left out of the rendered chat, so nothing is trained "
                "with --dataloader.earlier_reasoning context (split trains each in a row of its own)"
            )
        return rows

    def _tokens(self, text: str, spans: list[tuple[int, int]]) -> ChatTokens:
        ids, offsets = self.tokens.with_offsets(text)
        return ChatTokens(ids=ids, trained=overlapping(offsets, spans), text=text, offsets=offsets)


def weighted_out(conversation: Conversation) -> set[int]:
    """The assistant messages that OpenAI's fine-tuning format marks ``"weight": 0`` (kept as context, not
    trained); ``1`` or no weight trains. Any other value, or a weight on another role, is refused: it would
    otherwise be trained as if it meant nothing."""
    untrained = set()
    for i, message in enumerate(conversation.messages):
        if "weight" not in message:
            continue
        weight = message["weight"]
        if message.get("role") != "assistant":
            raise InvalidRecord(
                f"messages[{i}]: field 'weight' on a {message.get('role')} message (OpenAI's fine-tuning format "
                "weighs assistant messages only)"
            )
        if isinstance(weight, bool) or weight not in (0, 1):
            raise InvalidRecord(
                f"messages[{i}]: field 'weight' is {weight!r} (expected 0: context, not trained, or 1: trained, "
                "as in OpenAI's fine-tuning format)"
            )
        if weight == 0:
            untrained.add(i)
    return untrained


def overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """Per token: do its characters ``[start, end)`` overlap one of the sorted, disjoint ``spans``?"""
    if not offsets:
        return np.zeros(0, dtype=bool)
    token = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not spans:
        return np.zeros(len(token), dtype=bool)
    span = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    # The first span ending after the token starts is the only one it can overlap.
    k = np.searchsorted(span[:, 1], token[:, 0], side="right")
    inside = k < len(span)
    trained = np.zeros(len(token), dtype=bool)
    trained[inside] = token[inside, 1] > span[k[inside], 0]
    return trained
