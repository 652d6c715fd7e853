"""What a chat record must hold: messages as Qwen3's chat templates read them, and optional tool definitions.

Accepted, beside ``role`` and ``content``: ``reasoning_content`` (or ``thinking`` / ``reasoning``, the
names transformers reads as it) on assistant messages, ``<think>...</think>`` inside an assistant's
content, ``tool_calls`` (``[{"type": "function", "function": {"name": ..., "arguments": {...} or "..."}}]``,
or without the ``function`` wrapper), ``tool`` messages, and a record-level ``tools`` list (JSON schemas)
that the template writes into the system turn. Other keys are passed to the template untouched.

Keys whose value is null are dropped first, as transformers' ``apply_chat_template`` drops them: a
Parquet or Arrow file gives every message every key of its column (``tool_calls: null`` on a user turn).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from qwen3_titan_common.data.records import InvalidRecord, check_unicode, field_of, kind_of

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    def assistant_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def reasoning_of(message: dict[str, Any]) -> str:
    """The reasoning an assistant message carries (a reasoning key, else ``<think>`` text), stripped."""
    for key in REASONING_KEYS:
        if isinstance(message.get(key), str):
            return message[key].strip()
    content = message.get("content", "")
    if "</think>" in content:
        return content.split("</think>")[0].split("<think>")[-1].strip()
    return ""


def conversation_of(record: Any, messages_field: str, tools_field: str) -> Conversation:
    expected = "a list of {role, content} objects"
    messages = field_of(record, messages_field, expected)
    if not isinstance(messages, list | tuple):
        raise InvalidRecord(f"field '{messages_field}' is {kind_of(messages)} (expected {expected})")
    if not messages:
        raise InvalidRecord(f"field '{messages_field}' is empty (expected {expected})")
    checked = [_message(m, f"{messages_field}[{i}]") for i, m in enumerate(messages)]
    roles = [m["role"] for m in checked]
    if "assistant" not in roles:
        raise InvalidRecord(f"chat has no assistant turn (roles: {', '.join(roles)}); nothing to train on")
    answers = [(i, m) for i, m in enumerate(checked) if m["role"] == "assistant"]
    if all(
        not m.get("content", "").strip() and not m.get("tool_calls") and not reasoning_of(m)
        for _, m in answers
    ):
        where = ", ".join(f"{messages_field}[{i}]" for i, _ in answers)
        raise InvalidRecord(
            f"every assistant turn is empty ({where}); nothing to train on but the end-of-turn token"
        )
    tools = record.get(tools_field)
    if tools is not None:
        if not isinstance(tools, list | tuple) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRecord(
                f"field '{tools_field}' is {kind_of(tools)} (expected a list of tool definitions, JSON objects)"
            )
        tools = list(tools) or None
    return Conversation(checked, tools)


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise InvalidRecord(f"{where} is {kind_of(message)} (expected an object with field 'role')")
    message = {key: value for key, value in message.items() if value is not None}
    role = field_of(message, "role", "a string", owner=where)
    if not isinstance(role, str):
        raise InvalidRecord(f"{where}: field 'role' is {kind_of(role)} (expected a string)")
    if role == "assistant" and "tool_calls" in message:
        _check_tool_calls(message["tool_calls"], where)
        message.setdefault("content", "")  # a turn that only calls tools; Qwen3's templates read content
    content = field_of(message, "content", "a string", owner=where)
    if not isinstance(content, str):
        raise InvalidRecord(f"{where}: field 'content' is {kind_of(content)} (expected a string)")
    for key in REASONING_KEYS:
        if key in message and not isinstance(message[key], str):
            raise InvalidRecord(f"{where}: field '{key}' is {kind_of(message[key])} (expected a string)")
    for key, value in message.items():
        if isinstance(value, str):
            check_unicode(value, f"{where}: field '{key}'")
    return message


def _check_tool_calls(calls: Any, where: str) -> None:
    expected = 'a list of {"function": {"name": ..., "arguments": ...}} objects'
    if not isinstance(calls, list | tuple):
        raise InvalidRecord(f"{where}: field 'tool_calls' is {kind_of(calls)} (expected {expected})")
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise InvalidRecord(f"{at} is {kind_of(call)} (expected an object)")
        function = call.get("function", call)
        if not isinstance(function, dict):
            raise InvalidRecord(f"{at}: field 'function' is {kind_of(function)} (expected an object)")
        if not isinstance(function.get("name"), str):
            raise InvalidRecord(f"{at}: no function name (expected {expected})")
        arguments = function.get("arguments")
        if not isinstance(arguments, str | dict):
            raise InvalidRecord(
                f"{at}: 'arguments' is {kind_of(arguments)} (expected an object or a JSON string)"
            )
        if isinstance(arguments, str):
            # The template writes a string verbatim: the model would learn to call tools with it as written.
            try:
                parsed = json.loads(arguments)
            except ValueError as err:
                raise InvalidRecord(
                    f"{at}: 'arguments' is a string that is not JSON ({err}; expected a JSON object, "
                    "as a model's tool call writes it)"
                ) from None
            if not isinstance(parsed, dict):
                raise InvalidRecord(
                    f"{at}: 'arguments' is a JSON string holding {kind_of(parsed)} (expected a JSON object)"
                )
