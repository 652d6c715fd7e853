"""The stream of fixed-shape samples one data-parallel rank trains on, resumable from a checkpoint.

One global stream, whatever the layout: epoch ``e`` visits all records in one permutation drawn from
``(seed, e)`` (or file order without shuffling), and their documents are packed into one sequence of rows
(``data.packing``). The rows are dealt out in groups of ``dp_world_size x local_batch_size``: dp rank ``r``
takes rows ``r*b .. r*b+b-1`` of each group, one loader batch. So the rows of a step's global batch depend
only on the data, the seed, the step, the global batch size and the sequence length, never on how many ranks
or micro-batches share them (``--training.global_batch_size`` with gradient accumulation takes consecutive
groups). Every rank reads and packs the whole stream and keeps its rows: the price of that independence is
tokenizing every record on every rank (docs/parallelism.md). Dataloader workers of one rank take whole groups
in turn, as the loader takes batches from them.

Rows: documents (texts, conversations) packed several to a row; every sample carries per-document
positions, which the models turn into per-document attention.

Position: records of the epoch read, rows of the stream dealt, and the documents not yet in a row (the
packer's state). The position is taken between batches, after a whole group, so it is the same on every
rank and resumes on any number of them with the same global batch (docs/parallelism.md). An epoch ends with
``epoch += 1`` and a new order; documents still waiting go into the next epoch's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.tools.logging import logger

from qwen3_titan_common.data.chat import ChatTokenizer, EarlierReasoning
from qwen3_titan_common.data.conversation import conversation_of
from qwen3_titan_common.data.packing import (
    Document,
    Row,
    chat_document,
    make_packer,
    padding_row,
    text_document,
)
from qwen3_titan_common.data.preference import PreferenceTokenizer, pair_markers
from qwen3_titan_common.data.records import (
    BadRecordError,
    InvalidRecord,
    RecordFormat,
    SkippedRecords,
    text_of,
)
from qwen3_titan_common.data.sources import MAX_RECORD_BYTES, DatasetError, RawRecord, RecordSource
from qwen3_titan_common.data.tokens import DocumentTokenizer

Sample = tuple[dict[str, torch.Tensor], torch.Tensor]
# Records read and tokenized together: enough for the tokenizer's batch encoding to pay off,
# few enough that a resumed run re-reads little (read-ahead is not part of the saved position).
READ_AHEAD = 64
# Text of one read-ahead chunk beyond which tokenizing it gets a log line: it takes seconds.
_LOG_TOKENIZING_CHARS = 16 * 1024**2


@dataclass(frozen=True)
class StreamSettings:
    record_format: RecordFormat
    seq_len: int
    text_field: str = "text"
    messages_field: str = "messages"
    tools_field: str = "tools"
    earlier_reasoning: EarlierReasoning = "template"
    shuffle: bool = True
    seed: int = 0
    infinite: bool = True
    on_bad_record: Literal["stop", "skip"] = "stop"
    packing: bool = True
    max_record_chars: int = MAX_RECORD_BYTES
    share_prompt: bool = False  # preference pairs: the rejected completion continues the chosen one's prompt


def sample_of(row: Row, preference: bool = False) -> Sample:
    """A row as the Trainer takes it: positions go to the model, which masks attention by them.

    A row of preference pairs keeps its token labels and records as ``dpo_targets`` and ``dpo_records`` (the
    preference loss reads them, ``components.preference``), and its labels mark one token per pair: what
    torchtitan counts and divides the loss by is then the pairs, over ranks and micro-batches."""
    inputs, labels, positions, records = row
    input_dict = {"input": torch.from_numpy(inputs), "positions": torch.from_numpy(positions)}
    if not preference:
        return input_dict, torch.from_numpy(labels)
    input_dict["dpo_targets"] = torch.from_numpy(labels)
    input_dict["dpo_records"] = torch.from_numpy(records)
    return input_dict, torch.from_numpy(pair_markers(labels, positions))


class RecordStreamDataset(IterableDataset, Stateful):
    def __init__(
        self,
        source: RecordSource,
        tokens: DocumentTokenizer,
        settings: StreamSettings,
        *,
        dp_rank: int,
        dp_world_size: int,
        local_batch_size: int = 1,
    ):
        self.source = source
        self.tokens = tokens
        self.settings = settings
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.local_batch_size = local_batch_size
        self.chat = None
        self.preference: PreferenceTokenizer | None = None
        if settings.record_format == "chat":
            self.chat = ChatTokenizer(tokens, settings.earlier_reasoning)
        elif settings.record_format == "preference":
            self.preference = PreferenceTokenizer.of(
                tokens, settings.earlier_reasoning, settings.share_prompt
            )
            self.chat = self.preference.chat
        self.identical_pairs = 0  # preference pairs whose chosen and rejected are the same (no signal)
        self.epoch = 0
        self.next_record = 0  # records of the epoch already read
        self.rows_dealt = 0  # rows of the global stream dealt out so far, in whole groups
        self.packer = make_packer(settings.record_format, settings.packing, settings.seq_len, tokens.eos_id)
        self.skipped = SkippedRecords()

    # -- order and dealing -------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.settings.shuffle:
            return np.arange(len(self.source))
        return np.random.default_rng([self.settings.seed, epoch]).permutation(len(self.source))

    @property
    def group_rows(self) -> int:
        """Rows of the stream per loader batch of every rank: one group."""
        return self.dp_world_size * self.local_batch_size

    def takes_group(self, group: int) -> bool:
        """Whether this process keeps rows of the ``group``-th group: every group, or in a dataloader
        worker every ``num_workers``-th, as the loader takes its batches from the workers in turn."""
        worker = get_worker_info()
        return worker is None or group % worker.num_workers == worker.id

    def rows_of(self, group: list[Row]) -> list[Row]:
        """This rank's rows of one group."""
        first = self.dp_rank * self.local_batch_size
        return group[first : first + self.local_batch_size]

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self):
        while True:
            yield from self._dealt()
            whole_pass = self.next_record == 0
            if whole_pass:
                self.skipped = SkippedRecords()
            produced = yield from self._rest_of_epoch(self.epoch_order(self.epoch))
            where = f"in epoch {self.epoch}"
            if self.skipped.count and self.dp_rank == 0:  # every rank reads every record: one line
                logger.warning(self.skipped.summary(where))
            if whole_pass and not produced:
                raise DatasetError(
                    f"--dataloader.dataset '{self.source.name}': no usable record {where} "
                    f"({self.skipped.count} skipped as bad)"
                )
            if not self.settings.infinite:
                yield from self._dealt(final=True)
            self.epoch += 1
            self.next_record = 0
            if not self.settings.infinite:
                return  # iterating the loader again gives the next epoch
            if self.dp_rank == 0:
                logger.info(f"data: epoch {self.epoch} of {self.source.name} starts (new order)")

    def _rest_of_epoch(self, order: np.ndarray):
        """Yields this rank's samples until the epoch's records are read; returns whether any was usable."""
        produced = False
        while self.next_record < len(order):
            chunk = order[self.next_record : self.next_record + READ_AHEAD].tolist()
            records = self.source.read(chunk)
            if self.preference is not None:
                for index, record in zip(chunk, records, strict=True):
                    document = self._pair_document(index, record)
                    self.next_record += 1
                    if document is not None:
                        produced = True
                        self.packer.add(document)
                        yield from self._dealt()
            elif self.chat is None:
                for record, document in zip(records, self._tokenize_texts(records), strict=True):
                    # Counted before its rows are yielded: the saved position then covers every
                    # record whose tokens are already in the packer (and in the saved state).
                    self.next_record += 1
                    if isinstance(document, InvalidRecord):
                        self._bad(record, document)
                    elif (pairs := text_document(document, self.tokens.eos_id)) is not None:
                        produced = True
                        self.packer.add(pairs)
                        yield from self._dealt()
            else:
                for record in records:
                    documents = self._chat_documents(record)
                    self.next_record += 1
                    produced = produced or bool(documents)
                    for document in documents:
                        self.packer.add(document)
                    yield from self._dealt()
        return produced

    def _dealt(self, final: bool = False):
        """This rank's samples of every whole group the packer can fill; with ``final`` (the end of a finite
        run) also of a last group that padding rows complete, so that every rank ends on the same batch.

        A group's rows are taken off the packer before any of them is yielded: a checkpoint written while
        this batch trains holds only what comes after the group, the same position on every rank."""
        rows = self.group_rows
        while True:
            group = self.packer.take_rows(rows, final)
            if not group:
                return
            if len(group) < rows:
                group += [padding_row(self.settings.seq_len, self.tokens.eos_id)] * (rows - len(group))
            index = self.rows_dealt // rows
            self.rows_dealt += rows
            if self.takes_group(index):
                for row in self.rows_of(group):
                    yield sample_of(row, preference=self.preference is not None)

    def _tokenize_texts(self, records: list[RawRecord]) -> list[list[int] | InvalidRecord]:
        """Token ids of each record, or why it is bad; all texts of the chunk encoded in one call."""
        texts: list[str | InvalidRecord] = []
        limit = self.settings.max_record_chars
        for record in records:
            try:
                text = text_of(self._readable(record), self.settings.text_field)
                if len(text) > limit:
                    raise InvalidRecord(
                        f"field '{self.settings.text_field}' holds {len(text):,} characters, over the {limit:,} limit "
                        "for one record (--dataloader.max_record_bytes); split it, or raise the limit"
                    )
                self.tokens.check_plain(text, f"field '{self.settings.text_field}'", document=True)
                texts.append(text)
            except InvalidRecord as e:
                texts.append(e)
        valid = [t for t in texts if isinstance(t, str)]
        size = sum(len(t) for t in valid)
        if size > _LOG_TOKENIZING_CHARS:
            logger.info(f"data: tokenizing {size / 1024**2:.0f} M characters from {records[0].location} on")
        encoded = iter(self.tokens.documents(valid))
        return [next(encoded) if isinstance(t, str) else t for t in texts]

    def _chat_documents(self, record: RawRecord) -> list[Document]:
        """The record's conversations (several with earlier_reasoning="split"), or none for a bad one."""
        assert self.chat is not None
        try:
            conversation = conversation_of(
                self._readable(record), self.settings.messages_field, self.settings.tools_field
            )
            self.chat.check(conversation, self.settings.messages_field)
            return [
                chat_document(tokens, self.settings.seq_len, self.tokens.eos_id)
                for tokens in self.chat.tokenize(conversation)
            ]
        except InvalidRecord as e:
            self._bad(record, e)
            return []

    def _pair_document(self, index: int, record: RawRecord) -> Document | None:
        """The record's preference pair as one document, or None for a bad one."""
        assert self.preference is not None
        try:
            pair = self.preference.pair(self._readable(record), self.settings.seq_len)
        except InvalidRecord as e:
            self._bad(record, e)
            return None
        self.identical_pairs += pair.identical
        return pair.document(self.tokens.eos_id, index, self.settings.share_prompt)

    @staticmethod
    def _readable(record: RawRecord) -> Any:
        if record.error is not None:
            raise InvalidRecord(record.error)
        return record.value

    def _bad(self, record: RawRecord, reason: InvalidRecord) -> None:
        line = f"{record.location}: {reason}"
        if self.settings.on_bad_record == "stop":
            raise BadRecordError(
                f"{line} (fix it, or pass --dataloader.on_bad_record skip to go on without it)"
            )
        self.skipped.add(line)

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "next_record": self.next_record,
            "rows_dealt": self.rows_dealt,
            "packer": self.packer.state_dict(),
            "skipped": self.skipped.state_dict(),
            # Checked on load: a position only means something in the same data and order.
            "records": len(self.source),
            "format": self.settings.record_format,
            "order": f"seed {self.settings.seed}" if self.settings.shuffle else "file order",
            "rows": _rows_described(self.settings),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_rows = state_dict["rows"]
        saved = (state_dict["records"], state_dict["format"], state_dict["order"], saved_rows)
        now = self.state_dict()
        if saved != (now["records"], now["format"], now["order"], now["rows"]):
            raise DatasetError(
                f"the checkpoint's data position is for {saved[0]} {saved[1]} records in {saved[2]}, {saved[3]}, "
                f"but --dataloader.dataset '{self.source.name}' gives {now['records']} {now['format']} records in "
                f"{now['order']}, {now['rows']}; resume with the same data and settings, or use a new --dump_folder"
            )
        self.epoch = int(state_dict["epoch"])
        self.next_record = int(state_dict["next_record"])
        self.rows_dealt = int(state_dict["rows_dealt"])
        self.packer.load_state_dict(state_dict["packer"])
        self.skipped = SkippedRecords.from_state(state_dict["skipped"])


def _rows_described(settings: StreamSettings) -> str:
    """How documents become rows, as a checkpoint's data position records it."""
    if not settings.packing:
        return "one document per row" + (", prompt shared" if settings.share_prompt else "")
    if settings.record_format == "preference":
        return "pairs packed whole" + (", prompt shared" if settings.share_prompt else "")
    return "conversations packed whole" if settings.record_format == "chat" else "text packed as a stream"
