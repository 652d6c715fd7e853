"""What a record must look like, and what happens to one that does not.

Two shapes: plain text (``{"text": "..."}``) and chat (``{"messages": [{"role": ..., "content": ...}]}``,
checked in ``conversation``).
A record that cannot be trained on becomes one line naming where it is and what was expected,
e.g. ``data/train.jsonl:17: field 'text' missing (expected a string)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from qwen3_titan_common.data.sources import DatasetError, RawRecord
from qwen3_titan_common.errors import UserInputError

RecordFormat = Literal["text", "chat", "preference"]
MAX_LISTED_LOCATIONS = 5


class InvalidRecord(Exception):
    """Why one record cannot be trained on; the caller adds where it is."""


class BadRecordError(UserInputError):
    """Raised with ``on_bad_record="stop"``: one line, the record's location first."""


def kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def field_of(record: Any, name: str, expected: str, owner: str | None = None) -> Any:
    """``record[name]``; ``owner`` names a nested object in the message, e.g. ``messages[1]``."""
    if not isinstance(record, dict):
        raise InvalidRecord(
            f"{owner or 'record'} is {kind_of(record)} (expected an object with field '{name}')"
        )
    if name not in record:
        prefix = f"{owner}: " if owner else ""
        raise InvalidRecord(f"{prefix}field '{name}' missing (expected {expected})")
    return record[name]


def check_unicode(text: str, where: str) -> None:
    """Raises InvalidRecord when ``text`` (a record's field, named by ``where``) holds a lone surrogate,
    which JSON's ``\\ud800`` escape can write and no tokenizer reads."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRecord(
            f"{where} holds a lone surrogate ({text[err.start]!r} at character {err.start}), which is not "
            "text: a JSON \\ud800-\\udfff escape must come in a high-low pair"
        ) from None


def text_of(record: Any, text_field: str) -> str:
    text = field_of(record, text_field, "a string")
    if not isinstance(text, str):
        raise InvalidRecord(f"field '{text_field}' is {kind_of(text)} (expected a string)")
    check_unicode(text, f"field '{text_field}'")
    if not text.strip():
        raise InvalidRecord(f"field '{text_field}' is empty (expected some text)")
    return text


def detect_format(
    first_records: Sequence[RawRecord], *, text_field: str, messages_field: str, dataset: str
) -> RecordFormat:
    """``format="auto"``: preference if the first readable record has 'chosen' and 'rejected' (TRL's
    preference formats, ``data.preference``), chat if it has the messages field, else text."""
    for record in first_records:
        if not isinstance(record.value, dict):
            continue
        if "chosen" in record.value and "rejected" in record.value:
            return "preference"
        if messages_field in record.value:
            return "chat"
        if text_field in record.value:
            return "text"
        raise DatasetError(
            f"{record.location}: neither field '{messages_field}' (chat) nor '{text_field}' (text) "
            f"(fields: {', '.join(record.value) or 'none'}); set --dataloader.text_field, "
            "--dataloader.messages_field or --dataloader.format"
        )
    raise DatasetError(
        f"--dataloader.dataset '{dataset}': no readable record among the first {len(first_records)} "
        "(expected JSON objects with a text or messages field)"
    )


@dataclass
class SkippedRecords:
    """Bad records passed over in one pass over the data (``on_bad_record="skip"``)."""

    count: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        self.count += 1
        if len(self.first) < MAX_LISTED_LOCATIONS:
            self.first.append(line)

    def summary(self, where: str) -> str:
        more = ", ..." if self.count > len(self.first) else ""
        return f"data: skipped {self.count} bad record(s) {where}; first: {' | '.join(self.first)}{more}"

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "first": list(self.first)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SkippedRecords:
        return cls(count=int(state["count"]), first=list(state["first"]))
