"""Writes a complete Hugging Face model directory, shard by shard, atomically, and only where it may.

The files are planned first, from the shapes the export will receive (:func:`plan_shards`:
huggingface_hub's split, the one ``save_pretrained`` uses, run on meta tensors, so the file
names, the index and the total size are known before a trainer gathers the first tensor from
its shards); tensors then arrive one at a time and each file is written as soon as its last
tensor has arrived, so host memory stays at the model plus one file. Everything goes to a
hidden temporary directory beside the target, which is renamed into place only when complete:
a killed export never leaves a directory that looks loadable.

Beside the weights an export holds what inference reads: config.json, the tokenizer
(its ``model_max_length`` the model's ``max_position_embeddings``) and a
``generation_config.json``, the source's when it has one, else one that stops
``generate`` at the chat template's end of turn as well as at EOS. Every file and the
directory get the modes the user's umask gives new files, so that other users of a
shared filesystem can load what one user's job wrote.

No export ever replaces what the user owns. Exports go to ``<export root>/step-N``. Each completed
export carries :data:`EXPORT_MARKER`, written into its temporary directory as the last file before
the rename that completes it; an existing ``step-N`` is replaced only when it carries the marker
(:func:`check_replaceable`). Before training, the export root is checked as a whole
(:func:`check_export_root`): it must not be, hold or lie inside the model directory being trained or
the checkpoint folder, and if it exists it may hold nothing but this project's exports.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import StateDictSplit, split_torch_state_dict_into_shards
from huggingface_hub.constants import CONFIG_NAME, SAFETENSORS_INDEX_FILE
from safetensors.torch import save_file

from qwen3_titan_common.arch.architecture import architecture_from_config
from qwen3_titan_common.errors import CheckpointError
from qwen3_titan_common.hf.expected_keys import LM_HEAD, check_keys, expected_hf_shapes
from qwen3_titan_common.hf.model_card import CARD_NAME
from qwen3_titan_common.hf.model_dir import GENERATION_CONFIG, TOKENIZER_FILES
from qwen3_titan_common.perf.progress import Phase
from qwen3_titan_common.runtime.disk import check_free_space, disk_full_in, disk_full_message, looks_full

logger = logging.getLogger(__name__)

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
}


def parse_size(text: str, flag: str = "--hf.max_shard_size") -> int:
    """'5GB', '500MB', '2GiB' or a byte count.

    Ours rather than huggingface_hub's ``parse_size_to_int``, which knows only the decimal
    units (KB to TB): ``--hf.max_shard_size`` also takes binary units and plain byte counts.
    """
    value = text.strip().upper()
    number = value.rstrip("KMGIB")
    unit = value[len(number) :]
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except (KeyError, ValueError):
        raise CheckpointError(f"{flag} {text!r}: expected a size such as 500MB, 5GB or 2GiB") from None
    if size <= 0:
        raise CheckpointError(f"{flag} {text!r}: expected a positive size")
    return size


@dataclass(frozen=True)
class ExportSpec:
    out_dir: Path
    config: Mapping[str, Any]  # the source config.json, to be updated
    dtype: torch.dtype
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    assets_dir: Path | None = None  # tokenizer / generation_config to copy
    tie_word_embeddings: bool | None = None
    # The tensors the export will receive (HF key -> shape), in the order they come; the files
    # are planned from it. None: the architecture's in ``config``, without a tied lm_head.
    shapes: Mapping[str, tuple[int, ...]] | None = None
    model_card: str | None = None  # README.md (hf.model_card)
    # The source model's own generation_config.json when it is not in assets_dir (a model directory without
    # tokenizer files exports the run's tokenizer, but still its generation settings).
    generation_config: Path | None = None


# Where an export may be written (see the module docstring).
EXPORT_MARKER = ".qwen3-titan-export.json"
# What this project writes in an export root: model exports (step-N), and a LoRA run's adapters
# (adapter-step-N) and the frozen base they apply to (base).
_OWN_DIR = re.compile(r"^(step-\d+|adapter-step-\d+|base)$")
# Leftovers of this project's own exports that were killed (this module and adapter.py name them so).
_OWN_LEFTOVER = re.compile(r"^\.(step-\d+|adapter-step-\d+|base)\.(partial|old)-\d+$")


class ExportTargetError(CheckpointError):
    """An export would write over something this project did not write."""


def is_completed_export(directory: Path) -> bool:
    return (directory / EXPORT_MARKER).is_file()


def write_export_marker(directory: Path, files: list[str]) -> None:
    record = {"written_by": "qwen3-titan", "complete": True, "files": sorted(files)}
    (directory / EXPORT_MARKER).write_text(json.dumps(record, indent=2) + "\n")


def check_replaceable(out_dir: Path) -> None:
    """An existing export target must be a completed export of ours; called right before writing."""
    if out_dir.exists() and not (out_dir.is_dir() and is_completed_export(out_dir)):
        raise ExportTargetError(
            f"{out_dir}: exists and is not an export this project wrote (no {EXPORT_MARKER}); it is left "
            "untouched: move it away or pass another --hf.export_dir"
        )


def _related(a: Path, b: Path) -> str | None:
    if a == b:
        return "is"
    if b in a.parents:
        return "lies inside"
    if a in b.parents:
        return "contains"
    return None


def check_export_root(
    root: Path, *, shown: str, model_dir: Path | None, checkpoint_dir: Path, dump_folder: Path
) -> None:
    """Refuse an export root that would overwrite or mix with what the user owns; reads only, creates nothing.

    ``shown`` is how the message names the root (the flag, or the default under --dump_folder).
    """
    root = root.expanduser().resolve()
    if model_dir is not None:
        model_dir = model_dir.expanduser().resolve()
        relation = _related(root, model_dir)
        if relation is not None:
            raise ExportTargetError(
                f"{shown} {root}: {relation} the model directory being trained (--hf.model_dir {model_dir}); "
                "an export there could replace its files: pass another --hf.export_dir"
            )
        relation = _related(dump_folder.expanduser().resolve(), model_dir)
        if relation in ("is", "lies inside"):
            raise ExportTargetError(
                f"--dump_folder {dump_folder}: {relation} the model directory being trained "
                f"(--hf.model_dir {model_dir}); checkpoints and exports must not go into it: pass another --dump_folder"
            )
    checkpoint_dir = checkpoint_dir.expanduser().resolve()
    relation = _related(root, checkpoint_dir)
    if relation is not None:
        raise ExportTargetError(
            f"{shown} {root}: {relation} the checkpoint folder {checkpoint_dir}; exports and step checkpoints "
            "share step-N names there: pass another --hf.export_dir"
        )
    if not root.exists():
        return
    if not root.is_dir():
        raise ExportTargetError(f"{shown} {root}: is a file, not a directory; pass a directory for exports")
    foreign = sorted(
        entry.name
        for entry in root.iterdir()
        if not (
            (_OWN_DIR.match(entry.name) and entry.is_dir() and is_completed_export(entry))
            or _OWN_LEFTOVER.match(entry.name)
        )
    )
    if foreign:
        listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ExportTargetError(
            f"{shown} {root}: an existing directory holding files this project did not write ({listed}); "
            "exports go only to a new or empty directory or one holding earlier exports of this project: "
            "pass another --hf.export_dir"
        )


# Which tensor goes to which file, decided from the shapes alone (meta tensors), before any tensor exists.
def plan_shards(
    shapes: Mapping[str, Sequence[int]], dtype: torch.dtype, max_shard_bytes: int
) -> StateDictSplit:
    """Files of at most ``max_shard_bytes`` (a larger tensor gets a file of its own), in ``shapes`` order."""
    meta = {key: torch.empty(tuple(shape), dtype=dtype, device="meta") for key, shape in shapes.items()}
    return split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_bytes)


def index_json(plan: StateDictSplit, shapes: Mapping[str, Sequence[int]]) -> str:
    """``model.safetensors.index.json`` as transformers' ``save_pretrained`` writes it.

    transformers 5 adds ``total_parameters`` to huggingface_hub's ``total_size`` and
    sorts the keys; readers only need the ``weight_map``.
    """
    total_parameters = sum(torch.Size(shape).numel() for shape in shapes.values())
    index = {
        "metadata": {"total_parameters": total_parameters, **plan.metadata},
        "weight_map": plan.tensor_to_filename,
    }
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _ShardWriter:
    """Holds each planned file's tensors until its last one arrives, then writes the file.

    Tensors that arrive in the planned order keep at most one file in memory; a file is
    written by ``safetensors.torch.save_file``, which (since safetensors 0.8) writes from
    each tensor's storage without first serialising the file into one buffer.
    """

    def __init__(self, tmp_dir: Path, plan: StateDictSplit, shapes: Mapping[str, tuple[int, ...]], dtype):
        self.tmp_dir, self.plan, self.shapes, self.dtype = tmp_dir, plan, shapes, dtype
        self.waiting = {name: set(keys) for name, keys in plan.filename_to_tensors.items()}
        self.held: dict[str, dict[str, torch.Tensor]] = {}
        self.found: dict[str, tuple[int, ...]] = {}
        self.twice: list[str] = []
        self.failed = False

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.found:
            self.twice.append(key)
        self.found[key] = tuple(tensor.shape)
        self.failed = self.failed or key in self.twice or self.shapes.get(key) != self.found[key]
        if self.failed:
            # The export will be refused: keep draining (other ranks gather with us), hold nothing.
            self.held.clear()
            return
        name = self.plan.tensor_to_filename[key]
        self.held.setdefault(name, {})[key] = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous()
        self.waiting[name].discard(key)
        if not self.waiting[name]:
            save_file(self.held.pop(name), str(self.tmp_dir / name), metadata={"format": "pt"})

    def finish(self, where: str) -> None:
        """Refuse the export unless every planned tensor arrived once, with its planned shape."""
        if not self.found:
            raise CheckpointError("export: the model produced no tensors")
        if self.twice:
            raise CheckpointError(f"{where}: tensor '{self.twice[0]}' produced twice")
        check_keys(where, self.shapes, self.found, tied=False)
        if self.plan.is_sharded:
            (self.tmp_dir / SAFETENSORS_INDEX_FILE).write_text(index_json(self.plan, self.shapes))


def planned_shapes(spec: ExportSpec) -> dict[str, tuple[int, ...]]:
    """The tensors an export expects, in the order the files are planned."""
    if spec.shapes is not None:
        return {key: tuple(shape) for key, shape in spec.shapes.items()}
    arch = architecture_from_config(spec.config, "export config")
    tied = arch.tie_word_embeddings if spec.tie_word_embeddings is None else spec.tie_word_embeddings
    shapes = expected_hf_shapes(arch)
    if tied:
        del shapes[LM_HEAD]
    return shapes


def _export_config(spec: ExportSpec) -> dict[str, Any]:
    config = dict(spec.config)
    # Only what the export itself changed: the dtype on disk, and the tie if the run untied it.
    config["dtype"] = _dtype_name(spec.dtype)
    config.pop("torch_dtype", None)
    if spec.tie_word_embeddings is not None:
        config["tie_word_embeddings"] = spec.tie_word_embeddings
    return config


def _copy_assets(assets_dir: Path | None, tmp_dir: Path, config: Mapping[str, Any]) -> None:
    """The tokenizer files and generation config of ``assets_dir``; tokenizer_config.json's
    ``model_max_length`` becomes the model's ``max_position_embeddings``."""
    if assets_dir is None:
        return
    for name in (*TOKENIZER_FILES, GENERATION_CONFIG):
        source = assets_dir / name
        if source.is_file():
            # Contents only: a copied mode (a read-only package install, a private model
            # directory) would not be the export's.
            shutil.copyfile(source, tmp_dir / name)
    positions = config.get("max_position_embeddings")
    tokenizer_config = tmp_dir / "tokenizer_config.json"
    if isinstance(positions, int) and tokenizer_config.is_file():
        settings = json.loads(tokenizer_config.read_text())
        # Published tokenizers often say more (Qwen3's 131072, for a 40960-position model): past
        # max_position_embeddings the exported model has no positions, so transformers should warn there.
        if settings.get("model_max_length") != positions:
            settings["model_max_length"] = positions
            tokenizer_config.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# An answer no chat template writes itself, so that what follows it in a rendering is the template's.
_PROBE_ANSWER = "\u00a7answer"


def _end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template closes an assistant turn with (ChatML's ``<|im_end|>``), the
    token a chat-trained model ends its answer with; None without a template or such a token."""
    if not tokenizer.chat_template:
        return None
    probe = [{"role": "user", "content": "\u00a7question"}, {"role": "assistant", "content": _PROBE_ANSWER}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # a template that needs more than a plain two-message chat: no end of turn known
        return None
    if _PROBE_ANSWER not in text:
        return None
    after = text[text.index(_PROBE_ANSWER) + len(_PROBE_ANSWER) :].lstrip()
    ids = tokenizer.encode(after, add_special_tokens=False)
    added = tokenizer.added_tokens_decoder
    return ids[0] if ids and ids[0] in added and added[ids[0]].special else None


def _token_ids(config: Mapping[str, Any], tmp_dir: Path) -> dict[str, Any]:
    """bos/eos/pad for ``generate``: the exported tokenizer's, the end of turn first among the EOS ids
    (as Qwen3's own generation config lists ``[<|im_end|>, <|endoftext|>]``); config.json's where the
    tokenizer says nothing."""
    ids = {key: config[key] for key in _TOKEN_ID_KEYS if config.get(key) is not None}
    if not any((tmp_dir / name).is_file() for name in ("tokenizer.json", "vocab.json")):
        return ids
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tmp_dir))
    except Exception as err:  # whatever transformers refuses; the export itself must not fail for it
        logger.warning(
            f"[export] {GENERATION_CONFIG}: token ids from config.json only, the tokenizer does not load ({err})"
        )
        return ids
    from_config = ids.get("eos_token_id")
    from_config = from_config if isinstance(from_config, list) else [from_config]
    eos = [i for i in (_end_of_turn_id(tokenizer), tokenizer.eos_token_id, *from_config) if i is not None]
    eos = list(dict.fromkeys(eos))
    if eos:
        ids["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    for key, value in (("bos_token_id", tokenizer.bos_token_id), ("pad_token_id", tokenizer.pad_token_id)):
        if value is not None:
            ids[key] = value
    if "pad_token_id" not in ids and tokenizer.eos_token_id is not None:
        ids["pad_token_id"] = tokenizer.eos_token_id  # what generate pads with anyway, after a warning
    return ids


def _write_generation_config(config: Mapping[str, Any], tmp_dir: Path) -> None:
    """A generation_config.json for an export whose source has none.

    Without one transformers takes config.json's ``eos_token_id``, EOS alone: a chat-tuned model
    ends its turn with the template's end-of-turn token and, not stopped there, runs on past its answer.
    """
    from transformers import GenerationConfig

    GenerationConfig(**_token_ids(config, tmp_dir)).save_pretrained(str(tmp_dir))


def _umask_modes(directory: Path) -> tuple[int, int]:
    """The permission bits (files, directories) that new files and directories get in ``directory``:
    the user's umask, or a default ACL there.

    Read from a probe the kernel creates: ``os.umask`` can only be read by setting it, and a file
    another thread creates meanwhile would get the wrong mode.
    """
    probe = directory / ".mode-probe"
    probe.mkdir(mode=0o777)
    try:
        os.close(os.open(probe / "file", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        file_mode = stat.S_IMODE((probe / "file").stat().st_mode) & 0o777
        dir_mode = stat.S_IMODE(probe.stat().st_mode) & 0o777
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return file_mode, dir_mode


def _give_umask_modes(tmp_dir: Path) -> None:
    """Give everything under ``tmp_dir`` (itself included) the modes new files and directories get.

    safetensors' ``save_file`` writes through a private temporary file (0600), and a directory made by
    ``tempfile.mkdtemp`` is 0700: other users of a shared filesystem could not load the export. Done
    before the rename that completes the directory, so it never appears with other modes.
    """
    # Probed inside tmp_dir, which inherits its parent's default ACL: a probe left by a killed export
    # goes with the partial directory, never into the export root.
    file_mode, dir_mode = _umask_modes(tmp_dir)
    for root, dirs, files in os.walk(tmp_dir):
        for name in (*files, *dirs):
            path = os.path.join(root, name)
            if not os.path.islink(path):
                _chmod(path, dir_mode if name in dirs else file_mode)
    _chmod(tmp_dir, dir_mode)


def _chmod(path: str | Path, mode: int) -> None:
    # Keeps the setgid bit a shared group directory hands down to the directories made in it.
    os.chmod(path, (stat.S_IMODE(os.stat(path).st_mode) & ~0o777) | mode)


def _replace_dir(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the complete ``tmp_dir`` to ``out_dir``, replacing an export of ours there; everything in it
    first gets the modes the user's umask gives (:func:`_give_umask_modes`)."""
    _give_umask_modes(tmp_dir)
    check_replaceable(out_dir)
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
    tmp_dir.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export_hf_dir(
    spec: ExportSpec, tensors: Iterable[tuple[str, torch.Tensor]], expected_bytes: int | None = None
) -> Path:
    """Write ``tensors`` (HF key, tensor) and the metadata files to ``spec.out_dir``.

    Every planned tensor must arrive once with its planned shape; otherwise the whole
    iterable is still consumed (on several ranks each tensor is a collective) and the
    export is refused, leaving nothing behind. ``expected_bytes``, when given, replaces
    the plan's total size in the free-space check.
    """
    out_dir = spec.out_dir.resolve()
    # Before any tensor is asked for (on several ranks, a failing writer ends the run: torchrun stops
    # the others, whatever gather they wait in).
    check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shapes = planned_shapes(spec)
    plan = plan_shards(shapes, spec.dtype, spec.max_shard_bytes)
    check_free_space(
        out_dir.parent, plan.metadata["total_size"] if expected_bytes is None else expected_bytes, "export"
    )
    # Leftovers of exports to the same place that were killed: never complete, never read.
    for stale in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp_dir = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    tmp_dir.mkdir()
    try:
        writer = _ShardWriter(tmp_dir, plan, shapes, spec.dtype)
        with Phase(f"export to {out_dir}", total=plan.metadata["total_size"], unit="B") as phase:
            for key, tensor in tensors:
                writer.add(key, tensor)
                phase.advance(tensor.numel() * spec.dtype.itemsize)
        writer.finish(f"export {out_dir}")
        (tmp_dir / CONFIG_NAME).write_text(json.dumps(_export_config(spec), indent=2, sort_keys=True) + "\n")
        _copy_assets(spec.assets_dir, tmp_dir, spec.config)
        if spec.generation_config is not None:
            shutil.copyfile(spec.generation_config, tmp_dir / GENERATION_CONFIG)
        if not (tmp_dir / GENERATION_CONFIG).is_file():
            _write_generation_config(spec.config, tmp_dir)
        if spec.model_card is not None:
            (tmp_dir / CARD_NAME).write_text(spec.model_card)
        write_export_marker(tmp_dir, [f.name for f in tmp_dir.iterdir()])
        _replace_dir(tmp_dir, out_dir)
    except BaseException as err:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not isinstance(err, KeyboardInterrupt | SystemExit) and (
            disk_full_in(err) or looks_full(out_dir.parent)
        ):
            raise CheckpointError(disk_full_message(out_dir, "export")) from None
        raise
    return out_dir
