"""Where records come from: the ``--dataloader.dataset`` string resolved to files, read by index.

Every source gives random access by record index, because the dataset visits records in a
shuffled, per-epoch order and resumes from an index saved in the checkpoint. Each record
comes with its location (``data/train.jsonl:17``) so that errors can point at it.

- JSON Lines files are indexed once (byte offset of every non-blank line) and read lazily,
  so a file larger than memory still works and a bad line is reported with its number.
- Parquet files are read into memory, only the column that is trained on.
- ``datasets.Dataset.save_to_disk`` directories and Hub datasets are memory-mapped Arrow.
- A directory of files is split by ``datasets``' own file-name rules, as ``load_dataset`` splits it.
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from qwen3_titan_common.assets import default_corpus_path, default_pairs_path
from qwen3_titan_common.errors import UserInputError, first_line
from qwen3_titan_common.perf.progress import Phase

DEFAULT_DATASET = "default"
# The embedded preference pairs, built from the corpus (tools/make_preference_pairs.py): --objective dpo's demo.
DEFAULT_PAIRS = "default-pairs"
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = (
    "a .jsonl/.json (JSON Lines) or .parquet file, a directory of them, or a datasets.save_to_disk directory"
)
# One JSON line longer than this is a bad record, refused without being read: tokenizing it would take
# host memory ~150x its size (a 62 MB line took 9 GB) and minutes, with nothing to show for it.
MAX_RECORD_BYTES = 8 * 1024**2


class DatasetError(UserInputError):
    """The dataset as a whole cannot be used (missing path, unsupported format, no such column)."""


@dataclass(frozen=True)
class RawRecord:
    location: str  # "data/train.jsonl:17" or "data/part-0.parquet:row 16"
    value: Any  # the parsed record, normally a dict; None when unreadable
    error: str | None = None  # why the line could not be read (not JSON, not UTF-8)


class RecordSource(Protocol):
    name: str  # for log lines: the path as the user wrote it

    def __len__(self) -> int: ...

    def read(self, indices: Sequence[int]) -> list[RawRecord]: ...


@dataclass(frozen=True)
class ResolvedDataset:
    """What ``--dataloader.dataset`` names, checked without reading any record."""

    spec: str
    kind: Literal["files", "saved", "hub"]
    files: tuple[Path, ...] = ()
    saved_dir: Path | None = None
    note: str | None = None  # a choice made for the user (which split), logged once

    def describe(self) -> str:
        if self.kind == "files":
            return f"{len(self.files)} file(s)" if len(self.files) > 1 else "1 file"
        return "save_to_disk directory" if self.kind == "saved" else "Hugging Face Hub dataset"


def _download_hint(spec: str) -> str:
    return (
        f"--dataloader.dataset '{spec}': no such file or directory (relative paths are read from "
        f"{os.getcwd()}). If it is a Hugging Face Hub dataset, download it first: "
        f"`hf download --repo-type dataset {spec} --local-dir DIR` and pass --dataloader.dataset DIR "
        f"(or pass --dataloader.allow_network to download at start)"
    )


def _is_saved_dataset(directory: Path) -> bool:
    return (directory / "dataset_dict.json").is_file() or (
        (directory / "state.json").is_file() and (directory / "dataset_info.json").is_file()
    )


def _is_data_file(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES + PARQUET_SUFFIXES


def _resolve(pattern: str, base: str) -> list[str]:
    from datasets.data_files import resolve_pattern

    try:
        return resolve_pattern(pattern, base_path=base)
    except FileNotFoundError:  # a pattern that matches nothing; datasets' DataFilesList skips it too
        return []


def _split_files(directory: Path) -> tuple[dict[str, list[Path]], list[Path]]:
    """The directory's data files by split, as ``datasets.load_dataset(directory)`` assigns them, and all of them.

    Directories from the Hub keep every split side by side; reading all of them would train on the test set.
    The rules are datasets' own (``datasets.data_files.get_data_patterns``): shards named
    ``data/{split}-00000-of-00002.*``, else a split keyword as a word of a folder or file name (``train``/
    ``training``; ``validation``/``valid``/``dev``/``val``; ``test``/``testing``/``eval``/``evaluation``), else
    every file is ``train``; hidden files, ``__*`` folders and ``dataset_info.json``-like metadata are skipped.
    Where we differ from ``load_dataset``: only .jsonl/.json/.parquet files are kept (it reads the most common
    format and refuses mixed splits), a file that two patterns of a split match is read once (it reads it
    twice), and a split's files are in path order, so that a checkpointed order stays valid. Patterns are
    resolved with ``resolve_pattern`` rather than ``DataFilesDict.from_patterns``, which also stats every file
    for a cache hash we do not use and may show a progress bar.
    """
    from datasets.data_files import EmptyDatasetError, get_data_patterns

    base = directory.resolve().as_posix()
    # datasets joins its patterns onto the directory's path: a '[' or '*' in that path must match itself.
    pattern_base = glob.escape(base)

    def ours(matched: list[str]) -> list[Path]:
        relative = {Path(f).relative_to(base) for f in matched}
        return sorted(directory / r for r in relative if _is_data_file(r))

    try:
        patterns = get_data_patterns(pattern_base)
    except EmptyDatasetError:
        return {}, []
    except ValueError as e:  # data/{split}-00000-of-00001.* shards whose split is not a word
        raise DatasetError(
            f"--dataloader.dataset '{directory}': datasets cannot name its splits ({e}); rename the files "
            "data/SPLIT-00000-of-00001.EXT with SPLIT a word such as train or test"
        ) from None
    splits = {
        str(split): ours([f for p in split_patterns for f in _resolve(p, pattern_base)])
        for split, split_patterns in patterns.items()
    }
    return splits, ours(_resolve("**", pattern_base))


def _data_files(directory: Path, split: str) -> tuple[list[Path], str | None]:
    splits, found = _split_files(directory)
    if not found:
        return [], None
    readable = {name: files for name, files in splits.items() if files}
    if split in splits and split not in readable:
        raise DatasetError(
            f"--dataloader.dataset '{directory}': split '{split}' (as datasets.load_dataset splits the directory) "
            f"holds no .jsonl, .json or .parquet file; expected {SUPPORTED}"
        )
    if split not in readable:
        raise DatasetError(
            f"--dataloader.dataset '{directory}': no split '{split}' (splits found, named as "
            f"datasets.load_dataset names them: {', '.join(readable) or 'none with such files'}); pass one as --dataloader.split"
        )
    chosen = readable[split]
    if len(chosen) == len(found):
        return chosen, None
    return chosen, (
        f"reading split '{split}' only ({len(chosen)} of {len(found)} data files; splits: {', '.join(readable)}; "
        "--dataloader.split)"
    )


def resolve_dataset(spec: str, *, split: str = "train", allow_network: bool = False) -> ResolvedDataset:
    """Checks that ``spec`` names something readable; cheap enough to run when the config is built."""
    if spec == DEFAULT_DATASET:
        return ResolvedDataset(spec, "files", files=(default_corpus_path(),))
    if spec == DEFAULT_PAIRS:
        return ResolvedDataset(spec, "files", files=(default_pairs_path(),))
    if not spec:
        raise DatasetError(f"--dataloader.dataset is empty; pass {SUPPORTED}, or '{DEFAULT_DATASET}'")
    path = Path(spec).expanduser()
    if path.is_file():
        if not _is_data_file(path):
            raise DatasetError(
                f"--dataloader.dataset '{spec}': unsupported file type '{path.suffix or '(none)'}'; expected {SUPPORTED}"
            )
        return ResolvedDataset(spec, "files", files=(path,))
    if path.is_dir():
        if _is_saved_dataset(path):
            return ResolvedDataset(spec, "saved", saved_dir=path)
        files, note = _data_files(path, split)
        if not files:
            present = sorted(p.name for p in path.iterdir())[:8]
            raise DatasetError(
                f"--dataloader.dataset '{spec}': directory holds no .jsonl, .json or .parquet file and is not a "
                f"datasets.save_to_disk directory (found: {', '.join(present) or 'nothing'}); expected {SUPPORTED}"
            )
        return ResolvedDataset(spec, "files", files=tuple(files), note=note)
    other = _not_a_file_or_folder(path)
    if other is not None:
        raise DatasetError(
            f"--dataloader.dataset '{spec}': is {other}, not a data file or folder; expected {SUPPORTED}"
        )
    if allow_network and _looks_like_hub_id(spec):
        return ResolvedDataset(spec, "hub")
    raise DatasetError(_download_hint(spec))


def _not_a_file_or_folder(path: Path) -> str | None:
    """What ``path`` is when it exists as neither a regular file nor a folder (a named pipe would block the
    reader forever, a device never ends), in words; None when there is nothing there."""
    import stat

    try:
        mode = path.lstat().st_mode
    except OSError:
        return None
    if stat.S_ISLNK(mode):
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    kinds = {
        stat.S_ISFIFO: "a named pipe (FIFO)",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def split_names(spec: str, *, allow_network: bool = False) -> list[str]:
    """The splits ``spec`` holds, as ``--dataloader.split`` names them; ``[]`` where it cannot tell without
    the network (a Hub id). A single file, the embedded corpus and an un-split directory are one ``train``."""
    path = Path(spec).expanduser()
    if spec in (DEFAULT_DATASET, DEFAULT_PAIRS) or path.is_file():
        return ["train"]
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            return [str(s) for s in json.loads((path / "dataset_dict.json").read_text()).get("splits", [])]
        if _is_saved_dataset(path):
            return ["train"]
        splits, _ = _split_files(path)
        return [name for name, files in splits.items() if files]
    resolve_dataset(spec, allow_network=allow_network)  # raises the one-line error for a missing path
    return []


def _looks_like_hub_id(spec: str) -> bool:
    # "owner/name" or "name"; a missing local file (typo, wrong directory) must not go to the network.
    return (
        spec.count("/") <= 1
        and not spec.startswith(("/", ".", "~"))
        and Path(spec).suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES
    )


def _shown(path: Path, resolved: ResolvedDataset) -> str:
    """The path as the user would recognise it: under the directory they passed."""
    if resolved.spec in (DEFAULT_DATASET, DEFAULT_PAIRS):
        return f"<embedded corpus>/{path.name}"
    root = Path(resolved.spec).expanduser()
    if root.is_dir():
        return str(root / path.relative_to(root))
    return str(root)


class JsonlFile:
    """One JSON Lines file, indexed by the byte offset of each non-blank line."""

    def __init__(self, path: Path, name: str, max_record_bytes: int = MAX_RECORD_BYTES):
        from qwen3_titan_common.data.sniff import not_json_lines

        self.path = path
        self.name = name
        self.max_record_bytes = max_record_bytes
        problem = not_json_lines(path, name)
        if problem is not None:
            raise DatasetError(problem)
        offsets, line_numbers, lengths = [], [], []
        offset = 0
        # A pass over the whole file: minutes for tens of GB, shown past 5 s.
        with open(path, "rb") as f, Phase(f"indexing {name}", total=path.stat().st_size, unit="B") as phase:
            self._stamp = _stamp(os.fstat(f.fileno()))
            for number, (length, blank) in enumerate(_line_spans(f), start=1):
                if not blank:
                    offsets.append(offset)
                    line_numbers.append(number)
                    lengths.append(length)
                offset += length
                phase.advance(length)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._line_numbers = np.asarray(line_numbers, dtype=np.int64)
        self._lengths = np.asarray(lengths, dtype=np.int64)
        if path.suffix.lower() == ".json":
            self._refuse_plain_json()

    def _refuse_plain_json(self) -> None:
        # A .json file may hold one (pretty-printed) JSON document rather than JSON Lines; read
        # line by line it would fail on every line, one bad record at a time.
        first = self.first_line()
        if first and _parse_json_line(first, self.name).error is not None:
            convert = '`python -c "import json,sys; [print(json.dumps(r)) for r in json.load(sys.stdin)]" < IN > OUT.jsonl`'
            raise DatasetError(
                f"{self.name}: is not JSON Lines (its first line is not a JSON value); expected one JSON object "
                f"per line; a JSON array of records converts with {convert}"
            )

    def __len__(self) -> int:
        return len(self._offsets)

    def first_line(self) -> bytes:
        if not len(self):
            return b""
        with open(self.path, "rb") as f:
            f.seek(int(self._offsets[0]))
            return f.readline(self.max_record_bytes + 1)

    def _check_unchanged(self, f) -> None:
        """The index holds byte offsets: a file changed since (appended to, rewritten) would be read at the
        wrong places, its records reported as broken lines. Said as what it is instead."""
        now = _stamp(os.fstat(f.fileno()))
        if now != self._stamp:
            (size, _), (new_size, new_mtime) = self._stamp, now
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(new_mtime / 1e9))
            raise DatasetError(
                f"{self.name}: changed since this run read it (size {size:,} -> {new_size:,} bytes, modified "
                f"{when}); a run trains on its data as it was when it started: restore the file, or start a new "
                "run on the new one"
            )

    def read(self, indices: Sequence[int]) -> list[RawRecord]:
        records = []
        with open(self.path, "rb") as f:
            self._check_unchanged(f)
            for i in indices:
                location = f"{self.name}:{int(self._line_numbers[i])}"
                length = int(self._lengths[i])
                if length > self.max_record_bytes:
                    records.append(RawRecord(location, None, _too_long(length, self.max_record_bytes)))
                    continue
                f.seek(int(self._offsets[i]))
                records.append(_parse_json_line(f.readline(), location))
        return records


def _stamp(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns


def _line_spans(f, block: int = 1 << 20):
    """``(length in bytes, blank)`` of each line, never holding more than one block of a long line.

    Indexing needs only where each line starts and how long it is; ``for line in f`` would hold a
    whole 60 MB line in memory just to measure it.
    """
    pending, blank = 0, True
    while chunk := f.read(block):
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            piece = chunk[start : end + 1]
            yield pending + len(piece), blank and not piece.strip()
            pending, blank, start = 0, True, end + 1
        rest = chunk[start:]
        pending += len(rest)
        blank = blank and not rest.strip()
    if pending:
        yield pending, blank


def _size(nbytes: int) -> str:
    return f"{nbytes / 1024**2:.1f} MiB" if nbytes >= 1024**2 else f"{nbytes:,} bytes"


def _too_long(length: int, limit: int) -> str:
    return (
        f"line is {_size(length)}, over the {_size(limit)} limit for one record "
        "(--dataloader.max_record_bytes); not read: split it into several records, or raise the limit"
    )


def _parse_json_line(raw: bytes, location: str) -> RawRecord:
    try:
        return RawRecord(location, json.loads(raw.rstrip(b"\r\n")))
    except UnicodeDecodeError:
        return RawRecord(location, None, "line is not UTF-8 text")
    except json.JSONDecodeError as e:
        return RawRecord(location, None, f"line is not JSON ({e.msg}, column {e.colno})")


class ArrowColumns:
    """Rows of an Arrow table or ``datasets.Dataset``, restricted to the columns trained on."""

    def __init__(self, name: str, table: Any, columns: Sequence[str], row_label: str):
        self.name = name
        self._table = table
        self._columns = list(columns)
        self._row_label = row_label  # where row i is shown: f"{name}:row {i}"

    def __len__(self) -> int:
        return len(self._table)

    def read(self, indices: Sequence[int]) -> list[RawRecord]:
        import pyarrow as pa

        try:
            taken = _take(self._table, list(indices), self._columns)
        except (pa.ArrowException, OSError) as err:
            reason = first_line(err)
            raise DatasetError(
                f"{self._row_label}: rows {min(indices)}-{max(indices)} could not be decoded ({reason}); "
                "the data files are damaged: write them again"
            ) from None
        rows = [dict(zip(self._columns, values, strict=True)) for values in zip(*taken, strict=True)]
        return [RawRecord(f"{self._row_label}:row {i}", row) for i, row in zip(indices, rows, strict=True)]


def _take(table: Any, indices: list[int], columns: list[str]) -> list[list[Any]]:
    import pyarrow as pa

    if isinstance(table, pa.Table):
        taken = table.take(pa.array(indices, type=pa.int64()))
        return [taken.column(c).to_pylist() for c in columns]
    batch = table[indices]  # datasets.Dataset: one Arrow take, a dict of columns
    return [batch[c] for c in columns]


def _check_columns(
    name: str, present: Sequence[str], wanted: Sequence[str], optional: Sequence[str] = ()
) -> list[str]:
    """The wanted columns present (at least one must be), plus the optional ones present."""
    usable = [c for c in wanted if c in present]
    if not usable:
        raise DatasetError(
            f"{name}: no column {' or '.join(repr(c) for c in wanted)} (columns: {', '.join(present)}); "
            "set --dataloader.text_field / --dataloader.messages_field"
        )
    return usable + [c for c in optional if c in present and c not in usable]


def _unreadable_parquet(name: str, err: Exception) -> DatasetError:
    reason = first_line(err)
    return DatasetError(
        f"{name}: not a readable Parquet file ({reason}); it may be truncated or not Parquet at all: "
        "write it again, or remove it from the dataset"
    )


def parquet_columns(path: Path, name: str | None = None) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(path).names)
    except (pa.ArrowException, OSError) as err:
        raise _unreadable_parquet(name or str(path), err) from None


def open_parquet(path: Path, name: str, wanted: Sequence[str], optional: Sequence[str] = ()) -> ArrowColumns:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = _check_columns(name, parquet_columns(path, name), wanted, optional)
    try:
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as err:
        raise _unreadable_parquet(name, err) from None
    return ArrowColumns(name, table, columns, name)


def load_saved(directory: Path, split: str) -> Any:
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(str(directory))
    except Exception as err:  # datasets and pyarrow raise many types for a damaged directory
        reason = first_line(err)
        raise DatasetError(
            f"--dataloader.dataset '{directory}': the datasets.save_to_disk directory does not load "
            f"({type(err).__name__}: {reason}); save it again"
        ) from None
    if isinstance(loaded, DatasetDict):
        if split not in loaded:
            raise DatasetError(
                f"--dataloader.dataset '{directory}': no split '{split}' (splits: {', '.join(loaded)}); "
                "pass one as --dataloader.split"
            )
        loaded = loaded[split]
    return loaded


def load_hub(spec: str, split: str) -> Any:
    from datasets import load_dataset

    try:
        return load_dataset(spec, split=split)
    except Exception as e:  # network, authentication, unknown id, unknown split: all end the run here
        reason = (str(e).strip().splitlines() or [""])[0]
        raise DatasetError(
            f"--dataloader.dataset '{spec}': could not load it from the Hugging Face Hub ({type(e).__name__}: "
            f"{reason}); or download it yourself: `hf download --repo-type dataset {spec} --local-dir DIR`"
        ) from e


def open_arrow_dataset(
    dataset: Any, name: str, wanted: Sequence[str], optional: Sequence[str] = ()
) -> ArrowColumns:
    columns = _check_columns(name, list(dataset.column_names), wanted, optional)
    return ArrowColumns(name, dataset.select_columns(columns), columns, name)


class ConcatSource:
    """Several sources seen as one, record indices running through them in order."""

    def __init__(self, name: str, parts: Sequence[Any]):
        self.name = name
        self.parts = [p for p in parts if len(p)]
        self._starts = np.cumsum([0] + [len(p) for p in self.parts])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, indices: Sequence[int]) -> list[RawRecord]:
        if len(self.parts) == 1:
            return self.parts[0].read(indices)
        which = np.searchsorted(self._starts, indices, side="right") - 1
        out: list[RawRecord | None] = [None] * len(indices)
        for part in np.unique(which):
            slots = np.flatnonzero(which == part)
            local = [int(indices[s] - self._starts[part]) for s in slots]
            for slot, record in zip(slots, self.parts[part].read(local), strict=True):
                out[slot] = record
        return out  # type: ignore[return-value]


def open_source(
    resolved: ResolvedDataset,
    wanted_columns: Sequence[str],
    split: str,
    optional_columns: Sequence[str] = (),
    max_record_bytes: int = MAX_RECORD_BYTES,
) -> ConcatSource:
    """Opens what :func:`resolve_dataset` found. Columnar formats load only ``wanted_columns`` (one of them
    must exist) and those of ``optional_columns`` that exist."""
    name = {DEFAULT_DATASET: "the embedded corpus", DEFAULT_PAIRS: "the embedded pairs"}.get(
        resolved.spec, resolved.spec
    )
    if resolved.kind == "saved":
        assert resolved.saved_dir is not None
        return ConcatSource(
            name,
            [
                open_arrow_dataset(
                    load_saved(resolved.saved_dir, split), name, wanted_columns, optional_columns
                )
            ],
        )
    if resolved.kind == "hub":
        return ConcatSource(
            name, [open_arrow_dataset(load_hub(resolved.spec, split), name, wanted_columns, optional_columns)]
        )
    parts = []
    for path in resolved.files:
        shown = _shown(path, resolved)
        if path.suffix.lower() in PARQUET_SUFFIXES:
            parts.append(open_parquet(path, shown, wanted_columns, optional_columns))
        else:
            parts.append(JsonlFile(path, shown, max_record_bytes))
    return ConcatSource(name, parts)
