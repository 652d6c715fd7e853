"""A dataset's held-out share: records kept out of training for validation and ``eval``.

The share is chosen by record index from a seeded permutation whose seed is fixed here, not the training
order's ``--dataloader.seed``: changing the training order (or the number of ranks) never moves a record
from one part to the other, and every run, every validation and ``eval`` agree on which records are held
out. The training stream reads the rest; the two parts are disjoint and together cover the dataset.

Records, not tokens, are held out: a document is either wholly held out or wholly trained on, so packing
can never put a held-out document's tokens into a training row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from qwen3_titan_common.data.sources import DEFAULT_DATASET, DatasetError, RawRecord, RecordSource

# The embedded corpus's held-out part, and the share held out of other data when validation needs one.
DEFAULT_HELD_OUT = 0.05
# Fixed, and distinct from any training seed: which records are held out is a property of the dataset.
HELD_OUT_SEED = 0x5EED_0DD

Part = Literal["train", "held_out", "all"]


def check_share(share: float, flag: str = "--dataloader.held_out") -> None:
    if not 0.0 <= share < 1.0:
        raise DatasetError(f"{flag} {share}: expected a share of the records in [0, 1), e.g. 0.05")


def default_share(dataset: str) -> float:
    """The held-out share when none is given: the embedded corpus always keeps its held-out part out."""
    return DEFAULT_HELD_OUT if dataset == DEFAULT_DATASET else 0.0


def held_out_count(records: int, share: float) -> int:
    """How many of ``records`` are held out: at least one, and never all of them, when ``share`` > 0."""
    if share <= 0.0 or records < 2:
        return 0
    return min(records - 1, max(1, round(records * share)))


def held_out_indices(records: int, share: float) -> np.ndarray:
    """Indices (ascending) of the held-out records among ``records``."""
    chosen = np.random.default_rng(HELD_OUT_SEED).permutation(records)[: held_out_count(records, share)]
    return np.sort(chosen)


def part_indices(records: int, share: float, part: Part) -> np.ndarray:
    """Indices (ascending) of one part: ``train`` (the rest), ``held_out``, or ``all``."""
    if part == "all":
        return np.arange(records)
    held_out = held_out_indices(records, share)
    if part == "held_out":
        return held_out
    keep = np.ones(records, dtype=bool)
    keep[held_out] = False
    return np.flatnonzero(keep)


class SubsetSource:
    """The records of ``source`` at ``indices``, numbered 0..n-1; their locations stay the file's own."""

    def __init__(self, source: RecordSource, indices: np.ndarray, name: str):
        # Error lines name the dataset as the user gave it: record locations already say which file and line.
        self.source = source
        self.indices = indices
        self.name = name

    def __len__(self) -> int:
        return len(self.indices)

    def read(self, indices: Sequence[int]) -> list[RawRecord]:
        return self.source.read(self.indices[np.asarray(indices, dtype=np.int64)].tolist())


def select_part(source: RecordSource, share: float, part: Part) -> RecordSource:
    """``source`` itself, or the part of it that ``part`` names."""
    if part == "all" or (part == "train" and share <= 0.0):
        return source
    if part == "held_out" and held_out_count(len(source), share) == 0:
        why = "it has a single record" if len(source) < 2 else "--dataloader.held_out is 0"
        raise DatasetError(
            f"--dataloader.dataset '{source.name}': no held-out records for validation ({why}); pass "
            "--validator.dataloader.dataset PATH, a --dataloader.held_out share, or --validator.no-enable"
        )
    return SubsetSource(source, part_indices(len(source), share, part), source.name)
