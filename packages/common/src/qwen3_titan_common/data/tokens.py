"""Token ids for documents and chats, from the tokenizer the Trainer built.

The Trainer hands the dataloader a torchtitan ``BaseTokenizer``; its ``HuggingFaceTokenizer``
wraps a ``tokenizers.Tokenizer``, which encodes a whole batch of documents in Rust threads and
reports each token's character span (what assistant-only masking needs). Other tokenizers
still train plain text through ``encode``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtitan.components.tokenizer import BaseTokenizer

from qwen3_titan_common.data.sources import DatasetError


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

    def documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as ``[bos?] tokens [eos]``; bos only where the tokenizer defines one (Qwen3 does not)."""
        if self.fast is None:
            return [self.base.encode(text, add_bos=True, add_eos=True) for text in texts]
        # Special tokens are added here rather than by the tokenizer's post-processor, so the
        # result is the same whether or not that post-processor would have added a BOS.
        head = [self.bos_id] if self.bos_id is not None else []
        return [
            head + e.ids + [self.eos_id]
            for e in self.fast.encode_batch(list(texts), add_special_tokens=False)
        ]

    def with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of already-formatted text (a rendered chat) and each token's character span."""
        if self.fast is None:
            raise DatasetError(
                f"chat data needs a Hugging Face tokenizer (tokenizer.json) to locate assistant tokens; "
                f"got {type(self.base).__name__}"
            )
        # No special tokens added: a chat template writes its own (bos_token, <|im_start|>...).
        encoding = self.fast.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets
