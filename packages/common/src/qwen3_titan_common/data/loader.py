"""The torchtitan dataloader for the user's own text and chat data: ``--dataloader.dataset PATH``.

Composed into ``Trainer.Config.dataloader`` by ``build_trainer_config``; the Trainer calls
``config.dataloader.build(dp_world_size=..., dp_rank=..., tokenizer=..., seq_len=...,
local_batch_size=...)`` and gets batches ``({"input": (B, L)}, labels (B, L))``. See docs/data.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import tyro
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.tools.logging import logger

from qwen3_titan_common.data.chat import EarlierReasoning
from qwen3_titan_common.data.dataset import READ_AHEAD, RecordStreamDataset, StreamSettings
from qwen3_titan_common.data.holdout import Part, check_share, default_share, held_out_count, select_part
from qwen3_titan_common.data.records import RecordFormat, detect_format
from qwen3_titan_common.data.sources import (
    DEFAULT_DATASET,
    DEFAULT_PAIRS,
    MAX_RECORD_BYTES,
    DatasetError,
    RecordSource,
    ResolvedDataset,
    open_source,
    resolve_dataset,
)
from qwen3_titan_common.data.tokens import DocumentTokenizer

# The loader's key in a checkpoint's data state (torchtitan's own is one per dp rank), and what the position
# means, recorded beside the checkpoints (components.model_record) so that one of another meaning is refused by name.
POSITION_KEY = "position"
POSITION_FORMAT = "one packed stream, dealt to the ranks by global batch"
PER_RANK_POSITION = (
    "its data position is a per-rank share of the records, written before one packed stream was dealt to every "
    "layout; resume it with the version that wrote it, or start a new --dump_folder"
)


class TextChatDataLoader(ParallelAwareDataloader):
    """Plain text or chat (assistant tokens trained) from local files, packed, sharded and resumable."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = DEFAULT_DATASET
        """A .jsonl/.json (JSON Lines) or .parquet file, a directory of them, a datasets.save_to_disk
        directory, or 'default' (the embedded corpus). A Hub dataset id needs --dataloader.allow_network."""

        format: Literal["auto", "text", "chat", "preference"] = "auto"
        """'text': records hold text_field; 'chat': records hold messages_field; 'preference': records hold
        'chosen' and 'rejected' (and 'prompt'), for --objective dpo (docs/preference.md); 'auto': the first record
        decides."""

        text_field: str = "text"
        """Field of a plain-text record holding its text."""

        messages_field: str = "messages"
        """Field of a chat record holding its list of {role, content} messages."""

        tools_field: str = "tools"
        """Field of a chat record holding the tool definitions (JSON schemas) its template writes; optional."""

        earlier_reasoning: EarlierReasoning = "template"
        """An assistant turn whose reasoning the chat template leaves out of the full conversation (Qwen3's does
        for turns before the last user message): 'template' trains it as rendered, without its reasoning;
        'context' does not train it; 'split' trains it in a row of its own, the chat cut after it, with its
        reasoning."""

        split: str = "train"
        """Split read from a save_to_disk DatasetDict, a Hub dataset, or a directory whose file names name splits."""

        shuffle: bool = True
        """Visit records in a new seeded order each epoch (otherwise in file order)."""

        seed: int = 0
        """Seed of the per-epoch order; epoch e uses the permutation drawn from (seed, e)."""

        infinite: bool = True
        """Start a new epoch when the data runs out (otherwise training stops there)."""

        on_bad_record: Literal["stop", "skip"] = "stop"
        """'stop': a bad record stops training with one line naming it; 'skip': train on, and log how many
        were skipped at the end of each pass."""

        allow_network: bool = False
        """Let a dataset that is not a local path be downloaded from the Hugging Face Hub."""

        max_record_bytes: int = MAX_RECORD_BYTES
        """A record longer than this (a JSON line, in bytes; a text, in characters) is a bad record and
        is not tokenized: one huge record would take host memory ~150x its size."""

        packing: bool = True
        """Pack several documents into each row (conversations whole, text as one stream), each attending only
        to itself; --dataloader.no-packing puts one document in each row, padded (docs/data.md)."""

        share_prompt: Annotated[bool, tyro.conf.Suppress] = False
        """Preference pairs: the rejected completion continues the chosen one's prompt (set from
        --dpo.share_prompt, where the model's attention reads continuations)."""

        held_out: float | None = None
        """Share of the records kept out of training for validation (the same records in every run). Default:
        0.05 for the embedded corpus; for other data, 0.05 when validation reads this dataset and it has no
        validation/test split, else 0."""

        def __post_init__(self) -> None:
            if self.held_out is not None:
                check_share(self.held_out)
            if self.dataset_path is not None:
                raise DatasetError(
                    "--dataloader.dataset_path is not read by this dataloader; pass the path as --dataloader.dataset"
                )
            # Fails here, when the config is built from the command line, rather than after the model is.
            resolve_dataset(self.dataset, split=self.split, allow_network=self.allow_network)

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs,
    ):
        dataset = build_record_stream(
            config,
            tokenizer=tokenizer,
            seq_len=seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            local_batch_size=local_batch_size,
        )
        super().__init__(
            dataset,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            # Every batch exactly (local_batch_size, seq_len), the last one of a finite run included.
            drop_last=True,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )

    def state_dict(self) -> dict[str, Any]:
        """The stream's position, under one key for every rank: it is the same on all of them between
        batches (``data.dataset``), so a checkpoint resumes on any number of ranks. JSON, not torchtitan's
        per-rank pickle: a checkpoint's data position is read without unpickling anything."""
        # Past ParallelAwareDataloader's per-rank pickle, to the StatefulDataLoader state beneath it.
        return {POSITION_KEY: json.dumps(super(ParallelAwareDataloader, self).state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if (
            POSITION_KEY not in state_dict
        ):  # a checkpoint of before: components.model_record names its folder first
            raise DatasetError(f"the checkpoint: {PER_RANK_POSITION}")
        super(ParallelAwareDataloader, self).load_state_dict(json.loads(state_dict[POSITION_KEY]))


@dataclass(frozen=True)
class OpenedDataset:
    resolved: ResolvedDataset
    source: RecordSource  # the part asked for
    record_format: RecordFormat  # "auto" decided by the first records
    held_out: int = 0  # records of the whole dataset in its held-out share (0 when the part is "all")


def open_dataset(
    config: TextChatDataLoader.Config, part: Part = "all", announce: bool = True
) -> OpenedDataset:
    """The records ``config`` names, opened (columnar files: only the columns read) and their format;
    ``part``: the records training reads (all but the held-out share), the held-out share, or all records.
    ``announce``: log the dataset's note."""
    resolved = resolve_dataset(config.dataset, split=config.split, allow_network=config.allow_network)
    if resolved.note and announce:
        logger.info(f"data: {resolved.spec}: {resolved.note}")
    preference = ["chosen", "rejected"]
    wanted = {"text": [config.text_field], "chat": [config.messages_field], "preference": preference}.get(
        config.format, [config.messages_field, config.text_field, *preference]
    )
    optional = [] if config.format == "text" else [config.tools_field, "prompt"]
    if config.max_record_bytes < 1:
        raise DatasetError(
            f"--dataloader.max_record_bytes {config.max_record_bytes}: expected a positive size"
        )
    whole = open_source(resolved, wanted, config.split, optional, config.max_record_bytes)
    if not len(whole):
        raise DatasetError(f"--dataloader.dataset '{config.dataset}': no records (every file is empty)")
    share = config.held_out if config.held_out is not None else default_share(config.dataset)
    source = select_part(whole, share, part)
    record_format = config.format
    if record_format == "auto":
        first = source.read(list(range(min(READ_AHEAD, len(source)))))
        record_format = detect_format(
            first, text_field=config.text_field, messages_field=config.messages_field, dataset=config.dataset
        )
    held_out = held_out_count(len(whole), share) if part != "all" else 0
    return OpenedDataset(resolved, source, record_format, held_out)


def build_record_stream(
    config: TextChatDataLoader.Config,
    *,
    tokenizer: BaseTokenizer,
    seq_len: int,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int = 1,
    part: Part = "train",
    announce: bool = True,
) -> RecordStreamDataset:
    """The record stream of one rank; ``part``: the records training reads (all but the held-out share),
    the held-out share, or all records. ``announce``: log the summary lines."""
    opened = open_dataset(config, part, announce)
    resolved, source, record_format = opened.resolved, opened.source, opened.record_format
    settings = StreamSettings(
        record_format=record_format,
        seq_len=seq_len,
        text_field=config.text_field,
        messages_field=config.messages_field,
        tools_field=config.tools_field,
        earlier_reasoning=config.earlier_reasoning,
        shuffle=config.shuffle,
        seed=config.seed,
        infinite=config.infinite,
        on_bad_record=config.on_bad_record,
        packing=config.packing,
        max_record_chars=config.max_record_bytes,
        share_prompt=config.share_prompt and config.packing and record_format == "preference",
    )
    dataset = RecordStreamDataset(
        source,
        DocumentTokenizer(tokenizer),
        settings,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        local_batch_size=local_batch_size,
    )
    if announce:
        logger.info(
            _summary(
                resolved, len(source), settings, dp_rank, dp_world_size, config.format, part, opened.held_out
            )
        )
        if dataset.chat is not None and dataset.preference is None:
            logger.info(
                f"data: loss on {dataset.chat.method}; earlier reasoning: {settings.earlier_reasoning} "
                "(preview-data shows what is trained)"
            )
    return dataset


def _summary(
    resolved: ResolvedDataset,
    records: int,
    settings: StreamSettings,
    rank: int,
    world: int,
    asked: str,
    part: Part = "train",
    held_out: int = 0,
) -> str:
    chosen = f"{settings.record_format} (detected)" if asked == "auto" else settings.record_format
    if not settings.packing:
        shape = "one document per row, padded (--dataloader.no-packing)"
    elif settings.record_format == "chat":
        shape = "conversations packed whole, several to a row"
    elif settings.record_format == "preference":
        shape = (
            "pairs (the prompt once, then the chosen and the rejected completion) packed whole, several to a row"
            if settings.share_prompt
            else "pairs (chosen and rejected, each with its prompt) packed whole, several to a row"
        )
    else:
        shape = "documents packed as one stream"
    shape += ", each attending only to itself"
    if settings.record_format == "chat":
        shape += ", loss on assistant tokens"
    elif settings.record_format == "preference":
        shape = shape.replace("one document per row", "one pair per row") + ", loss on the completions"
    order = f"shuffled per epoch (seed {settings.seed})" if settings.shuffle else "file order"
    name = {DEFAULT_DATASET: "the embedded corpus", DEFAULT_PAIRS: "the embedded pairs"}.get(
        resolved.spec, resolved.spec
    )
    if part == "held_out":
        name = f"the held-out part of {name}"
    elif held_out:
        name = f"{name} less its {held_out:,} held-out records"
    return (
        f"data: {name} ({resolved.describe()}, {records:,} records, {chosen}); rows of {settings.seq_len} tokens, "
        f"{shape}; {order}; one stream of rows for the global batch, dealt to {world} dp rank(s) "
        f"(this is rank {rank})"
    )
