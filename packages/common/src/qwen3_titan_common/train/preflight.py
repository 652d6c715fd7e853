"""Checks a resolved training config before anything is written, in one function for both callers.

Every rank runs :func:`check_run` at the start of ``Qwen3Trainer.__init__``, before torchtitan initialises
distributed, creates the dump folder or reads a weight, so the upstream ``torchrun ... -m torchtitan.train`` form
fails the same way; the launcher's rehearsal of rank 0 (``--dry-run``, the fit check: ``train.rehearsal``) runs it
too. None of these checks writes anything; each failure is one line naming the flag, file or record.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from qwen3_titan_common.errors import UserInputError, first_line
from qwen3_titan_common.hf.expected_keys import LM_HEAD, expected_hf_shapes
from qwen3_titan_common.hf.export import EXPORT_DTYPES, check_export_root
from qwen3_titan_common.models.attention import uses_document_blocks
from qwen3_titan_common.models.layout import Layout, resolve_layout
from qwen3_titan_common.runtime.disk import (
    DiskSpaceError,
    NotWritableError,
    check_free_space,
    check_writable_dir,
    nearest_existing,
)
from qwen3_titan_common.train.field_checks import check_torchtitan_fields


def _check_tokenizer(path: str, vocab_size: int) -> None:
    tokenizer_json = Path(path) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise UserInputError(
            f"hf_assets_path {path}: no tokenizer.json there (expected a Hugging Face tokenizer directory)"
        )
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    except Exception as err:  # tokenizers raises its own Exception type for any unreadable file
        reason = first_line(err)
        raise UserInputError(f"{tokenizer_json}: not a readable tokenizer ({reason})") from None
    if size > vocab_size:
        raise UserInputError(
            f"hf_assets_path {path}: the tokenizer has {size} tokens, more than the model's vocab_size {vocab_size}"
        )


def _importable(module: str) -> bool:
    try:
        return bool(module) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package raises
        return False


def _check_override_imports(entries) -> None:
    # Resolve names only; importing is torchtitan's job (and only what the user named).
    for entry in entries:
        name = entry[0] if isinstance(entry, tuple | list) else entry
        if not (_importable(name) or _importable(name.rpartition(".")[0])):
            raise UserInputError(
                f"--override.imports {name}: no such module (expected an importable 'module.function' "
                "or a module defining @override factories)"
            )


def _uses_sdpa_or_varlen(model_config) -> bool:
    """torchtitan's own rule (``distributed.full_dtensor.validate_config``), read off the config."""
    from torchtitan.models.common.attention import ScaledDotProductAttention, VarlenAttention

    kinds = (ScaledDotProductAttention.Config, VarlenAttention.Config)
    layers = getattr(model_config, "layers", None) or []
    return any(
        isinstance(getattr(getattr(layer, "attention", None), "inner_attention", None), kinds)
        for layer in layers
    )


def _check_pipeline_microbatches(config, layout: Layout) -> None:
    """Each pipeline stage needs a micro-batch of its own at a time: the rank's batch splits into micro-batches of
    --parallelism.pipeline_parallel_microbatch_size, at least one per stage under a one-stage-per-rank schedule
    (1F1B, GPipe; torch refuses fewer on the first step)."""
    if layout.pp <= 1:
        return
    parallelism, batch = config.parallelism, config.training.local_batch_size
    size = parallelism.pipeline_parallel_microbatch_size
    if size < 1 or batch % size:
        raise UserInputError(
            f"--parallelism.pipeline_parallel_microbatch_size {size}: expected a positive divisor of "
            f"--training.local_batch_size (--batch-size) {batch}"
        )
    if parallelism.pipeline_parallel_schedule_csv:
        return
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    try:
        looped = issubclass(get_schedule_class(parallelism.pipeline_parallel_schedule), PipelineScheduleMulti)
    except ValueError:
        return  # an unknown schedule is torchtitan's to name
    if not looped and batch // size < layout.pp:
        raise UserInputError(
            f"--training.local_batch_size (--batch-size) {batch}: {batch // size} pipeline micro-batch(es) of "
            f"--parallelism.pipeline_parallel_microbatch_size {size}, fewer than the "
            f"{layout.pp} stages of --parallelism.pipeline_parallel_schedule {parallelism.pipeline_parallel_schedule}; "
            f"use --batch-size {layout.pp * size} or more"
        )


def _check_parallel_shapes(config, layout: Layout, tied: bool) -> None:
    parallelism, seq_len, arch = config.parallelism, config.training.seq_len, config.architecture
    tp_split = layout.tp if parallelism.enable_sequence_parallel else 1
    cp_split = 2 * layout.cp if layout.cp > 1 else 1
    if seq_len % (tp_split * cp_split):
        parts = []
        if tp_split > 1:
            parts.append(f"--parallelism.tensor_parallel_degree {layout.tp} (sequence parallel)")
        if cp_split > 1:
            parts.append(f"2 x --parallelism.context_parallel_degree {layout.cp}")
        divisor = tp_split * cp_split
        raise UserInputError(
            f"--training.seq_len {seq_len}: expected a multiple of {divisor} ({' x '.join(parts)}); "
            f"nearest valid: {max(divisor, round(seq_len / divisor) * divisor)}"
        )
    if arch is not None and layout.tp > 1:
        for field, heads in (
            ("num_attention_heads", arch.num_attention_heads),
            ("num_key_value_heads", arch.num_key_value_heads),
        ):
            if heads % layout.tp:
                raise UserInputError(
                    f"--parallelism.tensor_parallel_degree {layout.tp}: expected a divisor of the model's "
                    f"{field} {heads} (tensor parallelism splits attention heads across ranks)"
                )
    if arch is not None and layout.ep > 1:
        if arch.moe is None:
            raise UserInputError(
                f"--parallelism.expert_parallel_degree {layout.ep}: this model is dense (config.json has no "
                "experts to place on ranks); use 1"
            )
        if arch.moe.num_experts % layout.ep:
            raise UserInputError(
                f"--parallelism.expert_parallel_degree {layout.ep}: expected a divisor of the model's "
                f"num_experts {arch.moe.num_experts}"
            )
    if layout.pp > 1 and tied:
        raise UserInputError(
            f"--parallelism.pipeline_parallel_degree {layout.pp}: this model ties its output projection to its "
            "input embeddings (config.json tie_word_embeddings true), and the first and last pipeline stages "
            "cannot share one weight; use 1, or a model with untied embeddings"
        )
    model = config.model_spec.model
    if layout.cp > 1 and not uses_document_blocks(model) and _uses_sdpa_or_varlen(model):
        raise UserInputError(
            f"--parallelism.context_parallel_degree {layout.cp}: this backend's attention is SDPA, and "
            "torchtitan 0.3.0 runs context parallelism with Flex attention only; use 1"
        )


def _check_batch(config, layout: Layout) -> None:
    """The global batch splits into micro-batches of --training.local_batch_size on every data-parallel rank."""
    training = config.training
    wanted = training.global_batch_size
    ranks = layout.dp_replicate * layout.dp_shard
    micro = training.local_batch_size * ranks
    if wanted == 0 or wanted < -1 or (wanted > 0 and wanted % micro):
        raise UserInputError(
            f"--training.global_batch_size {wanted}: expected a multiple of --training.local_batch_size "
            f"(--batch-size) {training.local_batch_size} x {ranks} data-parallel rank(s) = {micro} (each step "
            "accumulates micro-batches of that size), or -1 for one micro-batch per step"
        )


def _check_loader_workers(loader) -> None:
    """The loader's worker settings that apply only with workers (their count is checked with torchtitan's fields,
    ``train.field_checks``)."""
    workers = getattr(loader, "num_workers", 0)
    if workers:
        prefetch = getattr(loader, "prefetch_factor", None)
        if prefetch is not None and prefetch < 1:
            raise UserInputError(f"--dataloader.prefetch_factor {prefetch}: expected a positive integer")
        return
    for name in ("prefetch_factor", "persistent_workers"):
        value = getattr(loader, name, None)
        if value not in (None, False):
            raise UserInputError(
                f"--dataloader.{name} {value}: applies only to loader worker processes, and "
                "--dataloader.num_workers is 0 (batches are read in the rank itself); set "
                "--dataloader.num_workers too, or drop it"
            )


def _check_conversion(config) -> None:
    """``--hf.to_dcp`` writes step-0 into the run's checkpoint folder: it needs weights to convert, a folder that
    holds no step yet (a run on it resumes its newest step, not step-0), and checkpoints on."""
    from qwen3_titan_common.hf.start import absolute

    if not config.hf.model_dir:
        raise UserInputError("--hf.to_dcp: converts --hf.model_dir (--hf-model DIR), and none is given")
    checkpoint = config.checkpoint
    if not checkpoint.enable or not getattr(checkpoint, "save_steps", True):
        raise UserInputError("--hf.to_dcp writes a torchtitan checkpoint: not with --checkpoint.no-enable")
    folder = Path(absolute(config.dump_folder)) / checkpoint.folder
    held = sorted(entry.name for entry in folder.glob("step-*")) if folder.is_dir() else []
    if held:
        raise UserInputError(
            f"{folder}: already holds {', '.join(held[:3])}; --hf.to_dcp writes step-0 into a checkpoint folder "
            "without steps (a run resumes its newest step): pass another --out"
        )


def _check_flags(config) -> None:
    hf = getattr(config, "hf", None)
    if hf is not None and hf.to_dcp:
        _check_conversion(config)
    check_torchtitan_fields(config)
    _check_loader_workers(config.dataloader)
    training, arch = config.training, config.architecture
    if arch is not None and training.seq_len > arch.max_position_embeddings:
        raise UserInputError(
            f"--training.seq_len {training.seq_len}: longer than the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )


def _export_root(config) -> tuple[Path, str]:
    if config.hf.export_dir:
        return Path(config.hf.export_dir), "--hf.export_dir"
    return Path(config.dump_folder) / "hf", "the export directory (--dump_folder's hf/)"


def _data_folders(config) -> list[tuple[str, Path]]:
    """The local folders the run reads data from, with the flag naming each."""
    folders = []
    validation = getattr(getattr(config, "validator", None), "dataloader", None)
    for flag, section in (
        ("--dataloader.dataset", config.dataloader),
        ("--validator.dataloader.dataset", validation),
    ):
        spec = getattr(section, "dataset", None)
        if isinstance(spec, str) and spec and spec != "default":
            path = Path(spec).expanduser()
            if path.is_dir():
                folders.append((f"{flag} {spec}", path.resolve()))
    return folders


def _check_dump_folder(config) -> None:
    dump = str(config.dump_folder)
    if not dump.strip():
        raise UserInputError(
            "--dump_folder (--out) is empty: expected a folder for the run's checkpoints, exports and logs"
        )
    where = Path(dump).expanduser().resolve()
    for shown, folder in _data_folders(config):
        if where == folder or folder in where.parents:
            raise UserInputError(
                f"--dump_folder (--out) {dump}: inside the data folder ({shown}); the run's files would "
                "sit among the data it reads; pass a folder outside it"
            )


def _check_writable(path, flag: str, deferred: list[str] | None) -> None:
    """``check_writable_dir``; for a job planned for other machines (``deferred``), a folder that does not
    exist here and cannot be made here (a cluster's /fsx seen from a laptop) is listed, not refused."""
    try:
        check_writable_dir(path, flag)
    except NotWritableError as err:
        if deferred is None or Path(path).expanduser().exists():
            raise
        deferred.append(str(err))


def _check_where_it_writes(config, deferred: list[str] | None = None) -> None:
    _check_dump_folder(config)
    _check_writable(config.dump_folder, "--dump_folder", deferred)
    checkpoint = config.checkpoint
    if checkpoint.enable and getattr(checkpoint, "save_steps", True):
        # Found now rather than at the first save (step 200 of a real-size config): the folder, under
        # --dump_folder or an absolute --checkpoint.folder elsewhere.
        _check_writable(Path(config.dump_folder) / checkpoint.folder, "--checkpoint.folder", deferred)
    if not config.hf.export:
        return
    root, shown = _export_root(config)
    _check_writable(root, shown.split(" ")[0] if config.hf.export_dir else "--dump_folder", deferred)
    model_dir = Path(config.hf.model_dir) if config.hf.model_dir else None
    check_export_root(
        root,
        shown=shown,
        model_dir=model_dir,
        checkpoint_dir=Path(config.dump_folder) / config.checkpoint.folder,
        dump_folder=Path(config.dump_folder),
    )


def _check_disk(config, deferred: list[str] | None) -> None:
    """Room for the first step checkpoint and the first export, before a rank is started."""
    arch = config.architecture
    if arch is None:
        return
    shapes = expected_hf_shapes(arch)
    stored = sum(torch.Size(s).numel() for s in shapes.values())
    params = stored - (torch.Size(shapes[LM_HEAD]).numel() if arch.tie_word_embeddings else 0)
    needs: dict[int, tuple[Path, int, list[str]]] = {}

    def need(path: Path, nbytes: int, what: str) -> None:
        device = os.stat(nearest_existing(path)).st_dev
        where, total, whats = needs.get(device, (path, 0, []))
        needs[device] = (where, total + nbytes, [*whats, what])

    if config.checkpoint.enable:
        # As DCP writes it: fp32 weights (a tied one twice) and AdamW's two fp32 moments.
        need(
            Path(config.dump_folder) / config.checkpoint.folder,
            4 * stored + 8 * params,
            "first step checkpoint",
        )
    if config.hf.export:
        name = config.hf.export_dtype
        itemsize = torch.tensor([], dtype=EXPORT_DTYPES.get(name, torch.float32)).element_size()
        need(_export_root(config)[0], itemsize * params, "Hugging Face export")
    for where, nbytes, whats in needs.values():
        try:
            check_free_space(where, nbytes, " and ".join(whats))
        except DiskSpaceError as err:
            if deferred is None:
                raise
            deferred.append(str(err))


def _check_data(config, layout: Layout) -> None:
    from qwen3_titan_common.data.first_records import check_first_records
    from qwen3_titan_common.data.loader import TextChatDataLoader

    if not isinstance(config.dataloader, TextChatDataLoader.Config):
        return
    record_format = check_first_records(config.dataloader)
    dataset = config.dataloader.dataset
    objective = getattr(config, "objective", "sft")
    if record_format == "preference" and objective != "dpo":
        raise UserInputError(
            f"--dataloader.dataset '{dataset}' holds preference pairs ('chosen', 'rejected'): train them with "
            "--objective dpo (docs/preference.md), or read its other fields with --dataloader.format chat|text"
        )
    if objective == "dpo" and record_format != "preference":
        raise UserInputError(
            f"--objective dpo: --dataloader.dataset '{dataset}' holds {record_format} records; preference training "
            "reads pairs with 'chosen' and 'rejected' fields (docs/preference.md)"
        )
    validator = getattr(config, "validator", None)
    held_out = getattr(validator, "dataloader", None)
    if not (
        validator.enable and isinstance(held_out, TextChatDataLoader.Config) and held_out.dataset != dataset
    ):
        return
    # Validation scores what training does: preference pairs under --objective dpo, tokens otherwise.
    validated = check_first_records(held_out)
    if (validated == "preference") != (record_format == "preference"):
        raise UserInputError(
            f"--validator.dataloader.dataset '{held_out.dataset}' holds {validated} records, and the run trains on "
            f"{record_format} records (--objective {objective}); validate on data of the kind it trains on"
        )


def check_run(
    config, world_size: int | None = None, *, tied: bool, deferred: list[str] | None = None
) -> Layout:
    """Every check of a run that needs no rank; returns the parallel layout it resolved.

    ``deferred``: for a dry run, which plans a job for other machines, the free-space check (about
    this machine's disk) appends its failure there instead of raising it. ``tied``: whether the model trained
    shares one matrix between its embedding and output projection (the trainer's ``trains_tied_embeddings``)."""
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    _check_flags(config)
    layout = resolve_layout(config.parallelism, world_size)
    _check_parallel_shapes(config, layout, tied)
    _check_pipeline_microbatches(config, layout)
    _check_batch(config, layout)
    if config.architecture is not None:
        _check_tokenizer(config.hf_assets_path, config.architecture.vocab_size)
    _check_override_imports(config.override.imports)
    _check_where_it_writes(config, deferred)
    _check_disk(config, deferred)
    _check_data(config, layout)
    return layout
