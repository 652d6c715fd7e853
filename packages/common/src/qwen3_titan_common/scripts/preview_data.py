"""``preview-data DATASET``: which tokens of the first records carry loss, before paying for a run.

    preview-data data/chat.jsonl --tokenizer assets/hf/Qwen3-4B-Instruct-2507
    preview-data data/chat.jsonl --tokenizer DIR -n 1 --json          # token ids and a 0/1 mask
    preview-data data/chat.jsonl --tokenizer DIR --rows 2 --seq-len 4096   # rows as they are packed

Reads the first N records in file order exactly as ``train`` reads them (the same dataloader flags,
the same chat template and masking): in the terminal each record is rendered with the trained text
highlighted; ``--json`` prints one JSON object per record, ``{"record", "format", "rows": [{"ids",
"mask"}]}`` (``mask[t]`` is 1 when token ``t`` is predicted with loss) or ``{"record", "error"}``.

``--rows N --seq-len L`` shows instead the first N rows that the training dataloader itself builds
(``TextChatDataLoader``, file order, one pass): the documents packed into each row with a marker at
each boundary, the padding summarised; ``--json`` prints one object per row, ``{"row", "documents":
[{"start", "ids", "mask"}], "padding"}``, where ``ids`` are the document's inputs and ``mask[t]`` is 1
when the label of input ``t`` carries loss.

Exits 1 when a previewed record would stop training, 2 on a dataset or tokenizer that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from qwen3_titan_common.scripts.trained_text import (
    PreviewRow,
    dataloader_config,
    highlighted,
)

DEFAULT_RECORDS = 3


@dataclass(frozen=True)
class PreviewRecord:
    location: str
    record_format: str
    rows: list[PreviewRow]
    error: str | None = None


def preview(args: argparse.Namespace) -> list[PreviewRecord]:
    from qwen3_titan_common.data import ChatTemplateTokenizer
    from qwen3_titan_common.data.chat import ChatTokenizer
    from qwen3_titan_common.data.loader import open_dataset
    from qwen3_titan_common.data.tokens import DocumentTokenizer

    opened = open_dataset(dataloader_config(args))
    tokens = DocumentTokenizer(ChatTemplateTokenizer.Config().build(tokenizer_path=str(args.tokenizer)))
    chat = ChatTokenizer(tokens, args.earlier_reasoning) if opened.record_format == "chat" else None
    records = opened.source.read(list(range(min(args.records, len(opened.source)))))
    if opened.record_format == "preference":
        from qwen3_titan_common.data.preference import PreferenceTokenizer

        pairs = PreferenceTokenizer.of(tokens, args.earlier_reasoning)
        return [_preview_pair(record, pairs, args) for record in records]
    return [_preview_record(record, opened.record_format, tokens, chat, args) for record in records]


def _preview_pair(record, pairs, args) -> PreviewRecord:
    """A preference record's two sequences, each with its completion marked (``data.preference``)."""
    from qwen3_titan_common.data.records import InvalidRecord
    from qwen3_titan_common.scripts.preview_rows import decoded_with_offsets

    tokens = pairs.tokens
    try:
        if record.error is not None:
            raise InvalidRecord(record.error)
        pair = pairs.pair(record.value, args.seq_len or 2**31)
    except InvalidRecord as e:
        return PreviewRecord(record.location, "preference", [], error=str(e))

    def decode(ids: list[int]) -> str:
        return tokens.base.decode(ids, skip_special_tokens=False)

    rows = []
    for title, side in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        ids = side.ids.tolist()
        text, offsets = decoded_with_offsets(ids, decode)
        rows.append(PreviewRow(ids, side.trained.astype(int).tolist(), text, offsets, title=title))
    return PreviewRecord(record.location, "preference", rows)


def _preview_record(record, record_format, tokens, chat, args) -> PreviewRecord:
    from qwen3_titan_common.data.conversation import conversation_of
    from qwen3_titan_common.data.packing import chat_document
    from qwen3_titan_common.data.records import InvalidRecord, text_of

    try:
        if record.error is not None:
            raise InvalidRecord(record.error)
        if chat is None:
            text = text_of(record.value, args.text_field)
            tokens.check_plain(text, f"field '{args.text_field}'", document=True)
            ids, offsets = tokens.with_offsets(text, document=True)
            # Text: every token but the first is a label (the first starts the document: no token before it).
            mask = [0] + [1] * (len(ids) - 1)
            return PreviewRecord(record.location, "text", [_row(ids, mask, text, offsets, args)])
        rows = []
        conversation = conversation_of(record.value, args.messages_field, args.tools_field)
        chat.check(conversation, args.messages_field)
        for chat_tokens in chat.tokenize(conversation):
            if args.seq_len:
                # The checks training makes, with the same error.
                chat_document(chat_tokens, args.seq_len, tokens.eos_id)
            mask = [int(t) for t in chat_tokens.trained]
            rows.append(_row(chat_tokens.ids, mask, chat_tokens.text, chat_tokens.offsets, args))
        return PreviewRecord(record.location, record_format, rows)
    except InvalidRecord as e:
        return PreviewRecord(record.location, record_format, [], error=str(e))


def _row(ids, mask, text, offsets, args) -> PreviewRow:
    # A row holds seq_len inputs and their seq_len labels: seq_len + 1 tokens of the conversation.
    keep = args.seq_len + 1 if args.seq_len else len(ids)
    return PreviewRow(ids[:keep], mask[:keep], text, offsets[:keep], dropped=max(0, len(ids) - keep))


def _report(record: PreviewRecord, color: bool) -> str:
    if record.error is not None:
        return f"{record.location}: {record.error}"
    lines = []
    for k, row in enumerate(record.rows):
        which = f", row {k + 1} of {len(record.rows)}" if len(record.rows) > 1 else ""
        if row.title:
            which = f", {row.title}"
        lines.append(
            f"== {record.location} ({record.record_format}{which}): {len(row.ids)} tokens, "
            f"{sum(row.mask)} trained"
        )
        lines.append(highlighted(row, color))
    return "\n".join(lines)


def _as_json(record: PreviewRecord) -> dict[str, Any]:
    if record.error is not None:
        return {"record": record.location, "error": record.error}
    rows = [
        {"ids": row.ids, "mask": row.mask, **({"kind": row.title} if row.title else {})}
        for row in record.rows
    ]
    return {"record": record.location, "format": record.record_format, "rows": rows}


def _parser() -> argparse.ArgumentParser:
    from qwen3_titan_common.assets import default_tokenizer_dir

    p = argparse.ArgumentParser(
        prog="preview-data",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("dataset", help="what --dataloader.dataset takes: a file, a directory, 'default'")
    p.add_argument(
        "--tokenizer",
        default=str(default_tokenizer_dir()),
        help="tokenizer directory, e.g. the model directory given to train --hf-model (default: the embedded one)",
    )
    p.add_argument(
        "-n", "--records", type=int, help=f"how many records, from the first (default {DEFAULT_RECORDS})"
    )
    p.add_argument(
        "--rows",
        type=int,
        metavar="N",
        help="show instead the first N rows the training dataloader builds (file order, one pass): the\n"
        "documents packed into each, their boundaries, the padding; needs --seq-len",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per record (token ids and a 0/1 mask), or per row with --rows",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="the run's --training.seq_len: each record cut as training cuts it; with --rows, the row length",
    )
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    # The dataloader's own flags, with its defaults (--dataloader.X in train).
    p.add_argument("--format", choices=("auto", "text", "chat", "preference"), default="auto")
    p.add_argument("--text-field", default="text")
    p.add_argument("--messages-field", default="messages")
    p.add_argument("--tools-field", default="tools")
    p.add_argument("--split", default="train")
    p.add_argument("--earlier-reasoning", choices=("template", "context", "split"), default="template")
    p.add_argument("--allow-network", action="store_true")
    # Only --rows reads these: the per-record view reports each bad record, and packs nothing.
    p.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-packing: one document per row, padded, as --dataloader.no-packing (--rows only)",
    )
    p.add_argument(
        "--share-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="preference pairs: the prompt once per pair, as --dpo.share_prompt does where the attention is the\n"
        "block-sparse one (CPU, Neuron); --no-share-prompt: each completion with its prompt (--rows only)",
    )
    p.add_argument(
        "--on-bad-record",
        choices=("stop", "skip"),
        default="stop",
        help="as --dataloader.on_bad_record: the rows stop where training would, or go on without it (--rows only)",
    )
    return p


def _bad_arguments(args: argparse.Namespace) -> str | None:
    """Why the command line cannot be previewed, in one line; None when it can."""
    for flag, n in (("-n", args.records), ("--rows", args.rows), ("--seq-len", args.seq_len)):
        if n is not None and n < 1:
            return f"{flag} {n}: expected a positive number"
    if args.rows is not None and args.records is not None:
        return "-n counts records, --rows counts rows: pass one of them"
    if args.rows is not None and args.seq_len is None:
        # No default: rows are packed to the run's length, and a guessed one shows rows no run trains on.
        return "--rows needs --seq-len, the run's --training.seq_len: rows are packed to that length"
    return None


def main(argv: list[str] | None = None) -> int:
    from qwen3_titan_common.errors import UserInputError

    args = _parser().parse_args(argv)
    if (problem := _bad_arguments(args)) is not None:
        print(f"preview-data: {problem}", file=sys.stderr)
        return 2
    color = args.color == "always" or (
        args.color == "auto" and sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
    )
    try:
        if args.rows is not None:
            from qwen3_titan_common.scripts.preview_rows import show_rows

            return show_rows(args, color)
        if args.records is None:
            args.records = DEFAULT_RECORDS
        records = preview(args)
    except (UserInputError, OSError) as err:
        from qwen3_titan_common.scripts.eval import in_command_flags

        print(f"preview-data: {in_command_flags(str(err), dataset='DATASET')}", file=sys.stderr)
        return 2
    for record in records:
        print(json.dumps(_as_json(record)) if args.json else _report(record, color))
    return 1 if any(r.error is not None for r in records) else 0


def console_main() -> None:
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # `preview-data ... | head`: the reader left; Python's documented way to exit quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)
