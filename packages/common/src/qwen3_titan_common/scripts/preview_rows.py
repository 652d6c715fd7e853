"""``preview-data --rows N --seq-len L``: the first rows the training dataloader builds, as they are packed.

Each row is cut where its positions restart at 0 (a document starts there): the documents are shown with
a marker at each boundary and their trained text highlighted as ``preview-data`` shows a record, the
padding summarised; ``--json`` gives one object per row. The rows come from ``TextChatDataLoader`` itself
(file order, one pass), not from a second packer.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qwen3_titan_common.scripts.trained_text import (
    CONTEXT_COLOR,
    RESET,
    PreviewRow,
    dataloader_config,
    highlighted,
)

# Where a document starts in a row. Not dim: the context text around it already is.
BOUNDARY_COLOR = "\x1b[1;36m"  # bold cyan
BOUNDARY = "\u2502"  # │doc 2│, with or without colour
REPLACEMENT_CHARACTER = "\ufffd"  # what decoding gives for a character whose bytes are not all there yet
MAX_UTF8_BYTES = 4

Decode = Callable[[list[int]], str]  # token ids to text, special tokens included


@dataclass(frozen=True)
class PackedDocument:
    """One document of a row (or the part of it the row holds): its (input, label) pairs."""

    start: int  # index of its first input in the row
    inputs: list[int]
    labels: list[int]  # IGNORE_INDEX where no loss is taken
    continued: bool = False  # the rest of the document the previous row ends with
    prompt_from: int = 0  # > 0: a rejected completion continuing its pair's prompt from this position

    @property
    def mask(self) -> list[int]:
        """1 where the label of input ``t`` carries loss."""
        from torchtitan.components.loss import IGNORE_INDEX

        return [int(label != IGNORE_INDEX) for label in self.labels]


@dataclass(frozen=True)
class PackedRow:
    number: int  # 1-based, as records are numbered
    documents: list[PackedDocument]
    padding: int  # EOS inputs at the end of the row, no label trained

    @property
    def trained(self) -> int:
        return sum(sum(d.mask) for d in self.documents)


@dataclass(frozen=True)
class RowsPreview:
    rows: list[PackedRow]
    seq_len: int
    asked: int  # rows asked for: fewer came when one pass over the data gives fewer
    error: str | None = None  # the bad record that stops training before the rows asked for


def preview_rows(args: argparse.Namespace, tokenizer) -> RowsPreview:
    """The first ``args.rows`` rows of the real training dataloader, in file order."""
    from qwen3_titan_common.data import BadRecordError
    from qwen3_titan_common.runtime.quiet import quiet_torchdata_set_vital

    config = dataloader_config(
        args,
        on_bad_record=args.on_bad_record,
        packing=args.packing,
        share_prompt=args.share_prompt,
        # The first rows in file order, and no second epoch: what is shown is what the data gives.
        shuffle=False,
        infinite=False,
    )
    with warnings.catch_warnings():
        quiet_torchdata_set_vital()  # torchdata's deprecated call, on every construction: noise here
        loader = config.build(
            dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=args.seq_len, local_batch_size=1
        )
    record_format = loader.dataset.settings.record_format
    rows: list[PackedRow] = []
    # Preference rows mark one label per pair for the loss's count; their token labels are dpo_targets.
    error = None
    try:
        for inputs, labels in loader:
            continued = bool(rows) and _continues_in_next_row(rows[-1], record_format, tokenizer.eos_id)
            rows.append(
                split_row(
                    len(rows) + 1,
                    inputs["input"][0].tolist(),
                    inputs.get("dpo_targets", labels)[0].tolist(),
                    inputs["positions"][0].tolist(),
                    tokenizer.eos_id,
                    continued,
                )
            )
            if len(rows) == args.rows:
                break
    except BadRecordError as e:
        error = str(e)
    return RowsPreview(rows, args.seq_len, args.rows, error)


def split_row(
    number: int, inputs: list[int], labels: list[int], positions: list[int], eos_id: int, continued: bool
) -> PackedRow:
    """A row cut where its positions restart at 0 (a document starts there) or continue a prompt (a preference
    pair's rejected completion, ``data.preference``); the padding is the last part, EOS inputs none of whose
    labels is trained: no document is like that (each has a trained label)."""
    from torchtitan.components.loss import IGNORE_INDEX

    starts = [k for k, p in enumerate(positions) if k == 0 or p == 0 or p != positions[k - 1] + 1]
    documents, padding = [], 0
    for start, end in zip(starts, [*starts[1:], len(inputs)], strict=True):
        part_inputs, part_labels = inputs[start:end], labels[start:end]
        is_padding = (
            end == len(inputs)
            and all(label == IGNORE_INDEX for label in part_labels)
            and all(t == eos_id for t in part_inputs)
        )
        if is_padding:
            padding = end - start
        else:
            documents.append(
                PackedDocument(
                    start, part_inputs, part_labels, continued and start == 0, prompt_from=positions[start]
                )
            )
    return PackedRow(number, documents, padding)


def _continues_in_next_row(row: PackedRow, record_format: str, eos_id: int) -> bool:
    """Whether the next row starts with the rest of this row's last document.

    A text document's last label is its EOS, so a full row whose last label is another token was cut inside
    a document and the packer puts the rest first in the next row. Exact but for a text that holds the EOS
    token itself right at the cut (then "continued" is not said). A conversation is never split.
    """
    if record_format != "text" or row.padding or not row.documents:
        return False
    return row.documents[-1].labels[-1] != eos_id


def document_view(document: PackedDocument, decode: Decode) -> PreviewRow:
    """The document as ``highlighted`` renders a record: its tokens, each marked when it is predicted with
    loss. Input ``t`` predicts label ``t``, so token ``t + 1`` is the trained one; the last label is shown
    too when it is trained (a text's EOS, or the first token of its rest in the next row)."""
    mask = document.mask
    ids = list(document.inputs)
    trained = [0, *mask[:-1]]
    if mask[-1]:
        ids.append(document.labels[-1])
        trained.append(1)
    text, offsets = decoded_with_offsets(ids, decode)
    return PreviewRow(ids, trained, text, offsets)


def decoded_with_offsets(ids: list[int], decode: Decode) -> tuple[str, list[tuple[int, int]]]:
    """The text of ``ids`` and each token's character span, decoded token by token.

    The bytes of one character can lie in several tokens: decoding waits for the token that completes it
    (its text no longer ends in U+FFFD), and those tokens share the character's span, as the tokenizer's
    own offsets give them when it encodes.
    """
    pieces: list[str] = []
    offsets: list[tuple[int, int]] = []
    length = 0
    waiting = 0  # tokens before this one whose character is not complete yet
    for k in range(len(ids)):
        piece = decode(ids[k - waiting : k + 1])
        incomplete = piece.endswith(REPLACEMENT_CHARACTER) and waiting < MAX_UTF8_BYTES - 1
        if incomplete and k + 1 < len(ids):
            waiting += 1
            continue
        pieces.append(piece)
        offsets.extend([(length, length + len(piece))] * (waiting + 1))
        length += len(piece)
        waiting = 0
    return "".join(pieces), offsets


def _row_report(row: PackedRow, decode: Decode, color: bool) -> str:
    count = sum(not d.prompt_from for d in row.documents)  # a pair's rejected continuation is part of its doc
    documents = "document" if count == 1 else "documents"
    used = sum(len(d.inputs) for d in row.documents)
    lines = [
        f"== row {row.number}: {count} {documents}, {used} tokens + {row.padding} padding, {row.trained} trained"
    ]
    body = []
    number = 0
    for document in row.documents:
        if document.prompt_from:
            label = f"doc {number}, rejected: continues its prompt at position {document.prompt_from}"
        else:
            number += 1
            label = f"doc {number}" + (", continued" if document.continued else "")
        body.append(_marker(label, color))
        body.append(highlighted(document_view(document, decode), color))
    text = "".join(body)
    if row.padding:
        if text and not text.endswith("\n"):  # the summary on a line of its own
            text += "\n"
        text += _styled(f"[padding: {_tokens(row.padding)}]", CONTEXT_COLOR, color)
    lines.append(text)
    return "\n".join(lines)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _marker(label: str, color: bool) -> str:
    return _styled(f"{BOUNDARY}{label}{BOUNDARY}", BOUNDARY_COLOR, color)


def _styled(text: str, style: str, color: bool) -> str:
    return f"{style}{text}{RESET}" if color else text


def _rows_summary(preview: RowsPreview) -> str:
    positions = len(preview.rows) * preview.seq_len
    trained = sum(row.trained for row in preview.rows)
    documents = sum(not d.prompt_from for row in preview.rows for d in row.documents)
    shown = (
        f"{len(preview.rows)} {'row' if len(preview.rows) == 1 else 'rows'} of {preview.seq_len} positions"
    )
    if not preview.rows:
        return f"{shown}: no row before the bad record" if preview.error else shown
    line = (
        f"{shown}: {trained:,} of {positions:,} positions trained ({trained / positions:.1%}), "
        f"{documents / len(preview.rows):.2f} documents per row"
    )
    if len(preview.rows) < preview.asked and preview.error is None:
        line += f"; one pass over the data gives only {len(preview.rows)}"
    return line


def _row_as_json(row: PackedRow) -> dict[str, Any]:
    documents = [{"start": d.start, "ids": d.inputs, "mask": d.mask} for d in row.documents]
    return {"row": row.number, "documents": documents, "padding": row.padding}


def show_rows(args: argparse.Namespace, color: bool) -> int:
    from qwen3_titan_common.data import ChatTemplateTokenizer

    tokenizer = ChatTemplateTokenizer.Config().build(tokenizer_path=str(args.tokenizer))
    preview = preview_rows(args, tokenizer)

    def decode(ids: list[int]) -> str:
        # Special tokens shown as themselves: <|im_start|>, <|endoftext|> are part of what is trained.
        return tokenizer.tokenizer.decode(ids, skip_special_tokens=False)

    for row in preview.rows:
        print(json.dumps(_row_as_json(row)) if args.json else _row_report(row, decode, color))
    if not args.json:
        print(_rows_summary(preview))
    if preview.error is not None:
        # The error names train's flag; this command's own spelling of it, on the same line.
        print(f"preview-data: {preview.error}; here: --on-bad-record skip", file=sys.stderr)
        return 1
    return 0
