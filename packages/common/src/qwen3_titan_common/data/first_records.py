"""The dataset checked before any rank starts: opened as the loader opens it, its first records read.

The same code paths as training (``loader.open_dataset``, ``records.text_of``,
``conversation.conversation_of``), without a tokenizer: a file that is missing, of the wrong kind,
empty, or whose first records are all unusable ends the launch in one line. A bad record further
in is found by the loader itself, in the rank, and named the same way.
"""

from __future__ import annotations

from qwen3_titan_common.data.conversation import conversation_of
from qwen3_titan_common.data.dataset import READ_AHEAD
from qwen3_titan_common.data.loader import TextChatDataLoader, open_dataset
from qwen3_titan_common.data.preference import CHOSEN, REJECTED
from qwen3_titan_common.data.records import BadRecordError, InvalidRecord, text_of
from qwen3_titan_common.data.sources import DatasetError


def _problem(record, config: TextChatDataLoader.Config, record_format: str) -> str | None:
    try:
        if record.error is not None:
            raise InvalidRecord(record.error)
        if record_format == "chat":
            conversation_of(record.value, config.messages_field, config.tools_field)
        elif record_format == "preference":
            for name in (CHOSEN, REJECTED):
                if not isinstance(record.value, dict) or name not in record.value:
                    raise InvalidRecord(f"field '{name}' missing (expected a string or a list of messages)")
        else:
            text_of(record.value, config.text_field)
    except InvalidRecord as reason:
        return f"{record.location}: {reason}"
    return None


def check_first_records(config: TextChatDataLoader.Config) -> str:
    """Raise the loader's own one-line error for what the first records show (any number of records
    feeds any number of ranks: rows of one stream are dealt to them, ``data.dataset``); returns the format."""
    opened = open_dataset(config)
    source = opened.source
    first = source.read(list(range(min(READ_AHEAD, len(source)))))
    problems = [p for p in (_problem(r, config, opened.record_format) for r in first) if p is not None]
    if not problems:
        return opened.record_format
    if config.on_bad_record == "stop":
        raise BadRecordError(
            f"{problems[0]} (fix it, or pass --dataloader.on_bad_record skip to go on without it)"
        )
    if len(problems) == len(first) == len(source):
        raise DatasetError(
            f"--dataloader.dataset '{source.name}': no usable record ({len(problems)} bad; first: {problems[0]})"
        )
    return opened.record_format
