"""The rows validation and ``eval`` read: one pass over held-out data, the same rows whatever the ranks.

Where they come from (:func:`choose_validation_data`, run by the trainer once it knows the training data):

- ``--validator.dataloader.dataset same`` (the default): the training dataset. Its ``validation`` split,
  else its ``test`` split, where it has one (a directory named by split, a ``DatasetDict``); otherwise its
  held-out share (``data.holdout``; the embedded corpus's always), which the training stream then never
  reads. An explicit ``--validator.dataloader.split`` other than the training split reads that split.
- ``--validator.dataloader.dataset PATH``: that file or directory (its ``validation``/``test`` split where
  it names splits), every record.

How the rows are dealt (:class:`ValidationRows`): the records are packed into rows exactly as for a single
rank (file order, no shuffling), and row ``i`` of the pass goes to the rank whose block of the global batch
holds it. The last global batch is filled up with padding rows whose labels are all ignored, so every rank
runs the same number of full ``(local_batch_size, seq_len)`` batches (one compiled shape on Neuron, no rank
waiting for another) and the loss is a sum over the same tokens on 1 rank or N: the validation loss does
not depend on the number of data-parallel ranks or the batch size.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

from qwen3_titan_common.data.dataset import RecordStreamDataset, Sample, sample_of
from qwen3_titan_common.data.holdout import DEFAULT_HELD_OUT, check_share
from qwen3_titan_common.data.loader import TextChatDataLoader, build_record_stream
from qwen3_titan_common.data.packing import padding_row
from qwen3_titan_common.data.sources import DEFAULT_DATASET, DatasetError, split_names

SAME = "same"  # the training dataset
AUTO = "auto"  # the split: validation, else test, else the held-out share (or all records of another path)
VALIDATION_SPLITS = ("validation", "test")


class ValidationRows(IterableDataset):
    """One pass over ``stream`` (a single-rank, finite record stream), this rank's rows of each global batch."""

    def __init__(
        self,
        stream: RecordStreamDataset,
        *,
        dp_rank: int,
        dp_world_size: int,
        local_batch_size: int,
        microbatches: int = 1,
    ):
        self.stream = stream
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.local_batch_size = local_batch_size
        self.microbatches = microbatches
        self._start = stream.state_dict()

    def padding_row(self) -> Sample:
        """A row that contributes nothing: EOS inputs, every label ignored."""
        row = padding_row(self.stream.settings.seq_len, self.stream.tokens.eos_id)
        return sample_of(row, preference=self.stream.preference is not None)

    def __iter__(self):
        # Every iteration is the same pass: the stream goes back to its first record.
        self.stream.load_state_dict(self._start)
        rows = iter(self.stream)
        # A validation step reads `microbatches` batches on each rank (pipeline parallelism): whole steps.
        per_rank = self.local_batch_size * self.microbatches
        global_batch = self.dp_world_size * per_rank
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        while True:
            group = list(itertools.islice(rows, global_batch))
            if not group:
                return
            group += [self.padding_row() for _ in range(global_batch - len(group))]
            yield from group[mine]


class ValidationDataLoader(ParallelAwareDataloader):
    """torchtitan's dataloader over :class:`ValidationRows`: every batch ``(local_batch_size, seq_len)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(TextChatDataLoader.Config):
        dataset: str = SAME
        """'same' (the training dataset), or a .jsonl/.json/.parquet file, a directory of them, a
        datasets.save_to_disk directory, or 'default' (the embedded corpus)."""

        split: str = AUTO
        """'auto': validation, else test, else the training data's held-out share (of another path: its
        validation/test split, else all of it); or a split name."""

        shuffle: bool = False
        """Visit the records in a seeded order (the order does not change the loss, only which rows pad)."""

        # Set from the training data (choose_validation_data), or by `eval`: not flags of their own.
        records: Annotated[Literal["held_out", "all"], tyro.conf.Suppress] = "all"
        """Which records of the dataset and split: its held-out share or all of them."""

        held_out: Annotated[float | None, tyro.conf.Suppress] = None
        """The held-out share of the dataset (the training data's --dataloader.held_out)."""

        microbatches: Annotated[int, tyro.conf.Suppress] = 1
        """Batches each rank reads per validation step (pipeline parallelism's micro-batches): the pass is
        padded to whole steps, so none of its rows is left out."""

        packing: Annotated[bool, tyro.conf.Suppress] = True
        """Whether rows hold several documents: the training data's --dataloader.packing, so validation rows
        are the kind the model trains on."""

        def __post_init__(self) -> None:
            if self.held_out is not None:
                check_share(self.held_out, "--validator.dataloader.held_out")
            if self.dataset != SAME and self.split != AUTO:
                TextChatDataLoader.Config.__post_init__(self)
            elif self.dataset != SAME:
                # The split is chosen later; the path is checked now, as for the training data.
                split_names(self.dataset, allow_network=self.allow_network)

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ):
        if config.dataset == SAME or config.split == AUTO:
            raise DatasetError(
                f"validation data: dataset '{config.dataset}', split '{config.split}' must be resolved against "
                "the training data first (choose_validation_data)"
            )
        # One pass, as a single rank would pack it: the rows do not depend on the ranks.
        single = dataclasses.replace(config, infinite=False)
        stream = build_record_stream(
            single, tokenizer=tokenizer, seq_len=seq_len, dp_rank=0, dp_world_size=1, part=config.records,
            announce=False,
        )  # fmt: skip
        rows = ValidationRows(
            stream,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            local_batch_size=local_batch_size,
            microbatches=config.microbatches,
        )
        # Workers would each deal the whole pass again: the pass is read in this process.
        super().__init__(
            rows, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size, num_workers=0
        )


def _fields_of_training(train: TextChatDataLoader.Config) -> dict:
    """What validation of the training dataset reads the way training does."""
    return {
        "dataset": train.dataset,
        "format": train.format,
        "text_field": train.text_field,
        "messages_field": train.messages_field,
        "allow_network": train.allow_network,
        "on_bad_record": train.on_bad_record,
    }


def _name(dataset: str) -> str:
    return "the embedded corpus" if dataset == DEFAULT_DATASET else f"'{dataset}'"


def choose_validation_data(
    train: TextChatDataLoader.Config, val: ValidationDataLoader.Config
) -> tuple[TextChatDataLoader.Config, ValidationDataLoader.Config, str]:
    """The training data config (its held-out share made explicit where validation reads it), the validation
    data config with dataset and split resolved, and one line saying where the validation data comes from."""
    # Inputs shaped as training shapes them: the model sees the same kind of rows.
    val = dataclasses.replace(val, packing=train.packing, share_prompt=train.share_prompt)
    if val.dataset != SAME:
        split = val.split
        if split == AUTO:
            names = split_names(val.dataset, allow_network=val.allow_network)
            split = next((s for s in VALIDATION_SPLITS if s in names), "train")
        chosen = dataclasses.replace(val, split=split, records="all")
        named = f" (split '{split}')" if Path(val.dataset).expanduser().is_dir() else ""
        return train, chosen, f"all of {_name(val.dataset)}{named}"
    same = dataclasses.replace(val, **_fields_of_training(train))
    explicit_share = train.held_out is not None and train.held_out > 0
    split = val.split
    if split == AUTO and not explicit_share:
        names = split_names(train.dataset, allow_network=train.allow_network)
        split = next((s for s in VALIDATION_SPLITS if s in names and s != train.split), AUTO)
    if split not in (AUTO, train.split):
        names = split_names(train.dataset, allow_network=train.allow_network)
        if names and split not in names:
            raise DatasetError(
                f"--validator.dataloader.split {split}: {_name(train.dataset)} has no such split (splits: "
                f"{', '.join(names)}); pass another, or --validator.dataloader.dataset PATH"
            )
        chosen = dataclasses.replace(same, split=split, records="all")
        return (
            train,
            chosen,
            f"split '{split}' of {_name(train.dataset)} (training reads split '{train.split}')",
        )
    share = train.held_out if train.held_out is not None else DEFAULT_HELD_OUT
    if share <= 0:
        raise DatasetError(
            f"--dataloader.held_out 0 leaves validation no data from {_name(train.dataset)}: pass a share such as "
            "0.05, --validator.dataloader.dataset PATH, or --validator.no-enable"
        )
    train = dataclasses.replace(train, held_out=share)
    chosen = dataclasses.replace(same, split=train.split, held_out=share, records="held_out")
    line = f"the held-out {share:.0%} of {_name(train.dataset)}"
    if train.dataset != DEFAULT_DATASET:
        line += f" (split '{train.split}')"
    return train, chosen, line + ", never trained on (--dataloader.held_out)"
