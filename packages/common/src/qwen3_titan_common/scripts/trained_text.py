"""What both ``preview-data`` views share: the dataloader config they read with, and a row's text with its
trained tokens marked (highlighted in a terminal, between brackets without colour)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

TRAINED_COLOR = "\x1b[1;30;42m"  # bold, black on green
CONTEXT_COLOR = "\x1b[2m"  # dim
RESET = "\x1b[0m"
TRAINED_OPEN, TRAINED_CLOSE = "\u27e6", "\u27e7"  # without colour: trained text between these


@dataclass(frozen=True)
class PreviewRow:
    ids: list[int]
    mask: list[int]  # 1: the token is predicted with loss
    text: str
    offsets: list[tuple[int, int]]
    dropped: int = 0  # tokens cut by --seq-len
    title: str = ""  # what the row is, where a record gives several kinds (a pair's chosen and rejected)


def dataloader_config(args: argparse.Namespace, **more):
    """The dataloader config ``train`` would build from the same ``--dataloader.*`` flags; ``more``: other fields."""
    from qwen3_titan_common.data import TextChatDataLoader

    return TextChatDataLoader.Config(
        dataset=args.dataset,
        format=args.format,
        text_field=args.text_field,
        messages_field=args.messages_field,
        tools_field=args.tools_field,
        split=args.split,
        earlier_reasoning=args.earlier_reasoning,
        allow_network=args.allow_network,
        **more,
    )


def highlighted(row: PreviewRow, color: bool) -> str:
    """The row's text, each run of trained tokens marked.

    Byte-level tokens of one character share its offsets: each character is shown once, with the first
    token that reaches past it.
    """
    out, at, run = [], 0, None
    for (_, end), trained in zip(row.offsets, row.mask, strict=True):
        if end <= at:
            continue
        if trained != run:
            out.append(_close(run, color))
            out.append(_open(trained, color))
            run = trained
        out.append(row.text[at:end])
        at = end
    out.append(_close(run, color))
    if row.dropped:
        out.append(f"\n... {row.dropped} more token(s) cut by --seq-len {len(row.ids) - 1}")
    return "".join(out)


def _open(trained: int | None, color: bool) -> str:
    if color:
        return TRAINED_COLOR if trained else CONTEXT_COLOR
    return TRAINED_OPEN if trained else ""


def _close(run: int | None, color: bool) -> str:
    if run is None:
        return ""
    if color:
        return RESET
    return TRAINED_CLOSE if run else ""
