"""Token ids for documents and chats, from the tokenizer the Trainer built.

The Trainer hands the dataloader a torchtitan ``BaseTokenizer``; its ``HuggingFaceTokenizer``
wraps a ``tokenizers.Tokenizer``, which encodes a whole batch of documents in Rust threads and
reports each token's character span (what assistant-only masking needs). Other tokenizers
still train plain text through ``encode``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from torchtitan.components.tokenizer import BaseTokenizer

from qwen3_titan_common.data.records import InvalidRecord, check_unicode
from qwen3_titan_common.data.sources import DatasetError


def special_token_texts(tokenizer_dir: str | None) -> tuple[str, ...]:
    """The special tokens' texts as the tokenizer's files declare them: ``tokenizer_config.json``'s
    ``added_tokens_decoder`` (which wins), then ``tokenizer.json``'s ``added_tokens``.

    Read from the files because the loaded tokenizer cannot say: torchtitan re-adds every configured token
    with ``add_special_tokens``, which marks Qwen3's ``<think>`` and ``<tool_call>`` special although the
    files mark them as text a model writes (and a chat record may hold).
    """
    if not tokenizer_dir:
        return ()
    # Each dataloader (training, validation) asks; tokenizer.json is ~11 MB for Qwen3, so it is parsed once per
    # process and version of the files.
    return _special_token_texts(
        str(tokenizer_dir),
        *(_mtime(Path(tokenizer_dir) / n) for n in ("tokenizer.json", "tokenizer_config.json")),
    )


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


@functools.cache
def _special_token_texts(tokenizer_dir: str, *_versions: int | None) -> tuple[str, ...]:
    special: dict[str, bool] = {}
    for name, entries in (
        ("tokenizer.json", lambda data: data.get("added_tokens") or []),
        ("tokenizer_config.json", lambda data: list((data.get("added_tokens_decoder") or {}).values())),
    ):
        try:
            data = json.loads((Path(tokenizer_dir) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for entry in entries(data) if isinstance(data, dict) else ():
            if isinstance(entry, dict) and isinstance(entry.get("content"), str):
                special[entry["content"]] = bool(entry.get("special", False))
    return tuple(sorted(text for text, flag in special.items() if flag))


class DocumentTokenizer:
    def __init__(self, tokenizer: BaseTokenizer):
        if tokenizer.eos_id is None:
            raise DatasetError(
                "the tokenizer has no eos_token (tokenizer_config.json); packing needs it between documents"
            )
        self.base = tokenizer
        self.eos_id: int = tokenizer.eos_id
        self.bos_id: int | None = getattr(tokenizer, "bos_id", None)
        from tokenizers import Tokenizer

        inner = getattr(tokenizer, "tokenizer", None)
        self.fast: Tokenizer | None = inner if isinstance(inner, Tokenizer) else None
        # The text of each special token (<|endoftext|>, <|im_start|>, ...): tokenizers encodes such text
        # as the token itself wherever it appears, so a record holding it would end a document, or open a
        # chat turn, that the data never meant.
        self.special_texts: tuple[str, ...] = special_token_texts(getattr(tokenizer, "tokenizer_path", None))

    def check_plain(self, text: str, where: str, *, document: bool = False) -> None:
        """Raises InvalidRecord when ``text`` (a record's field, named by ``where``) is not text a tokenizer
        reads or holds a special token's text. ``document``: a plain-text record, whose special tokens' texts
        (``<|endoftext|>`` in code or docs) are encoded as the text they are (:meth:`documents`) where the
        tokenizer can; only a chat's fields, among which a template writes its own tokens, refuse them."""
        check_unicode(text, where)
        if document and self.fast is not None:
            return
        found = [special for special in self.special_texts if special in text]
        if found:
            raise InvalidRecord(
                f"{where} holds the special token text {', '.join(found)}, which would be encoded as the token "
                "itself (ending the document or opening a chat turn there); remove it from the data (the loader "
                "writes the tokens that separate documents and turns)"
            )

    def documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as ``[bos?] tokens [eos]``; bos only where the tokenizer defines one (Qwen3 does not)."""
        if self.fast is None:
            return [self.base.encode(text, add_bos=True, add_eos=True) for text in texts]
        # Special tokens are added here rather than by the tokenizer's post-processor, so the
        # result is the same whether or not that post-processor would have added a BOS.
        head = [self.bos_id] if self.bos_id is not None else []
        with self._special_texts_as_text():
            encoded = self.fast.encode_batch(list(texts), add_special_tokens=False)
        return [head + e.ids + [self.eos_id] for e in encoded]

    @contextmanager
    def _special_texts_as_text(self) -> Iterator[None]:
        """The fast tokenizer encoding a special token's text as ordinary text (tokenizers'
        ``encode_special_tokens``) inside the block: a text record's ``<|endoftext|>`` is seven characters of
        its document, not the end of it. Restored after, for the chats' rendered templates."""
        assert self.fast is not None
        before = self.fast.encode_special_tokens
        self.fast.encode_special_tokens = True
        try:
            yield
        finally:
            self.fast.encode_special_tokens = before

    def with_offsets(self, text: str, *, document: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of already-formatted text (a rendered chat) and each token's character span; ``document``:
        a plain-text record's, its special tokens' texts encoded as text (as :meth:`documents` does)."""
        if self.fast is None:
            raise DatasetError(
                f"chat data needs a Hugging Face tokenizer (tokenizer.json) to locate assistant tokens; "
                f"got {type(self.base).__name__}"
            )
        # No special tokens added: a chat template writes its own (bos_token, <|im_start|>...).
        if document:
            with self._special_texts_as_text():
                encoding = self.fast.encode(text, add_special_tokens=False)
        else:
            encoding = self.fast.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets
