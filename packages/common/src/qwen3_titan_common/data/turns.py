"""Where each assistant turn lies in the full rendering of a conversation, in characters.

A turn is what the model writes: everything after the header inference supplies (the generation
prompt's role header, ``<|im_start|>assistant\\n``) up to and including the end-of-turn marker
(``<|im_end|>``). That includes whatever the template renders for the turn in this conversation: a
``<think>`` block (empty or not), tool calls. Two ways to find turns:

- a template with ``{% generation %}`` blocks marks them itself (transformers' spans, ``ChatRenderer``);
- any other template: ``TurnMarkers`` learns the assistant header and the end-of-turn marker once,
  from a probe conversation, and ``locate`` finds them in each full rendering. Nothing is rendered
  twice, so a template that renders a turn differently depending on what follows it (Qwen3's drops
  earlier reasoning and adds an empty ``<think>`` block to the last turn) is read as it renders.

The header is the part of the generation prompt that every assistant turn starts with: Qwen3-Thinking's
prompt ``<|im_start|>assistant\\n<think>\\n`` starts only the turns after the last user message, so the
header is ``<|im_start|>assistant\\n`` and the ``<think>`` line belongs to the turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_titan_common.data.conversation import Conversation
from qwen3_titan_common.data.records import InvalidRecord
from qwen3_titan_common.data.sources import DatasetError
from qwen3_titan_common.data.template import ChatRenderer

# Texts no template writes on its own, so that finding them in a rendering finds the message.
_PROBE_TEXTS = ("\u00a7q-one", "\u00a7a-one", "\u00a7q-two", "\u00a7a-two")


@dataclass(frozen=True)
class TurnMarkers:
    header: str  # written before every assistant turn, not trained
    end: str  # closes every assistant turn, trained

    @classmethod
    def probe(cls, renderer: ChatRenderer) -> TurnMarkers:
        """The header and end-of-turn marker of ``renderer``'s template, from a two-round probe chat."""
        q1, a1, q2, a2 = _PROBE_TEXTS
        probe = [
            {"role": "user", "content": q1},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": q2},
            {"role": "assistant", "content": a2},
        ]
        before = renderer.render(probe[:1]).text
        prompt = renderer.render(probe[:1], add_generation_prompt=True).text
        if not prompt.startswith(before) or not prompt[len(before) :].strip():
            raise DatasetError(
                "the chat template writes no generation prompt (add_generation_prompt), so assistant turns "
                "cannot be told apart; mark them with {% generation %} ... {% endgeneration %}"
            )
        generation_prompt = prompt[len(before) :]
        full = renderer.render(probe).text
        positions = [full.find(text) for text in _PROBE_TEXTS]
        if -1 in positions or positions != sorted(positions):
            raise DatasetError("the chat template does not write each message's content once, in order")
        # The longest end of the text before the first answer that begins the generation prompt.
        lead = full[: positions[1]]
        header = next(
            (generation_prompt[:n] for n in range(len(generation_prompt), 0, -1)
             if lead.endswith(generation_prompt[:n])),
            "",
        )  # fmt: skip
        end = full[positions[3] + len(a2) :].rstrip()
        if not header.strip() or not end or not full[positions[1] + len(a1) :].startswith(end):
            raise DatasetError(
                "the chat template's assistant turns have no fixed header and end-of-turn marker "
                f"(header {header!r}, end {end!r}); mark them with {{% generation %}} ... {{% endgeneration %}}"
            )
        return cls(header=header, end=end)

    def locate(self, text: str, conversation: Conversation) -> list[tuple[int, int]]:
        """The character span of each assistant turn of ``conversation`` in its rendering ``text``."""
        assistants = conversation.assistant_indices()
        starts = []
        at = text.find(self.header)
        while at != -1:
            starts.append(at + len(self.header))
            at = text.find(self.header, starts[-1])
        if len(starts) != len(assistants):
            raise InvalidRecord(self._miscount(len(starts), conversation))
        spans = []
        for k, start in enumerate(starts):
            end = text.find(self.end, start)
            following = starts[k + 1] - len(self.header) if k + 1 < len(starts) else len(text)
            if end == -1 or end + len(self.end) > following:
                raise InvalidRecord(
                    f"messages[{assistants[k]}]: the rendered turn has no end-of-turn marker {self.end!r}"
                )
            spans.append((start, end + len(self.end)))
        return spans

    def _miscount(self, found: int, conversation: Conversation) -> str:
        for i, message in enumerate(conversation.messages):
            if message["role"] != "assistant" and any(
                isinstance(v, str) and self.header in v for v in message.values()
            ):
                return (
                    f"messages[{i}] ({message['role']}) contains the chat template's assistant header "
                    f"{self.header!r}, so assistant turns cannot be located"
                )
        return (
            f"the rendered chat holds {found} assistant header(s) {self.header!r} for "
            f"{len(conversation.assistant_indices())} assistant message(s); the template drops or merges "
            "assistant turns, or a message contains the header"
        )
