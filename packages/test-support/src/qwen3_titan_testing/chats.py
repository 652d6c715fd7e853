"""Chat records in the shapes Qwen3 users bring: multi-turn, reasoning, tool calls, a system turn."""

from __future__ import annotations

import json
from typing import Literal

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def sample_chat(rounds: int, *, system: bool, kind: Literal["plain", "reasoning", "tools"]) -> dict:
    """A record of ``rounds`` user questions, each answered.

    ``reasoning``: every answer carries reasoning, as ``reasoning_content`` in even rounds and as
    ``<think>...</think>`` in the content in odd ones. ``tools``: every answer first calls the ``add`` tool
    (with reasoning), reads a ``tool`` turn, then answers; the record lists the tool under ``tools``.
    """
    messages = [{"role": "system", "content": "You are a careful, terse assistant."}] if system else []
    for r in range(rounds):
        messages.append({"role": "user", "content": f"Question {r}: what is {r} plus {r + 1}?"})
        answer = f"It is {2 * r + 1}."
        if kind == "plain":
            messages.append({"role": "assistant", "content": answer})
        elif kind == "reasoning":
            thought = f"Adding {r} and {r + 1} gives {2 * r + 1}."
            if r % 2:
                messages.append({"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{answer}"})
            else:
                messages.append({"role": "assistant", "content": answer, "reasoning_content": thought})
        else:
            call = {"type": "function", "function": {"name": "add", "arguments": {"a": r, "b": r + 1}}}
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": f"I will call add for round {r}.",
                    "tool_calls": [call],
                }
            )
            messages.append({"role": "tool", "content": json.dumps({"result": 2 * r + 1})})
            messages.append({"role": "assistant", "content": answer})
    record: dict = {"messages": messages}
    if kind == "tools":
        record["tools"] = [ADD_TOOL]
    return record
