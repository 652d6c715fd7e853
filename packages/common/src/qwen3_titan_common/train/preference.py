"""The reference of preference training: each pair's log-probabilities under the model training starts from.

DPO compares the policy's log-probabilities with a reference model's. Rather than keep a second model in
memory and run it every step, the starting model computes every pair's once, before step 1 (one forward pass
over the training pairs, in file order, dealt to the data-parallel ranks as training deals rows), and the
table goes to ``<dump_folder>/reference_logps.safetensors``: per record of the training data, the chosen and
rejected completions' summed log-probabilities. A resumed run reads it back (its weights have moved since;
recomputing would change the reference), and refuses one written for other data. With validation on, the
held-out pairs get theirs the same way, from the rows validation reads, into
``reference_logps_validation.safetensors``.

The values are those of the step-1 forward up to the order of floating-point sums: the same model, the same
per-document attention, in the training's own context (``train_context``), without gradients.

``--dpo.reference live`` (:class:`LiveReference`) scores each step's pairs instead, just before the step: the
starting values of the trained weights, copied once and kept in the step checkpoints, are swapped into the
model for a forward without gradients. The same model code in every layout (each rank swaps its own shards),
with one more copy of the trained weights in memory (with LoRA, of the adapters only) and one more forward per
step; no pass over pairs the run never reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader, default_collate
from torchtitan.tools.logging import logger

from qwen3_titan_common.compat import without_checkpoint_wrapper
from qwen3_titan_common.components.preference import PreferenceLoss, sum_dtype, take_preference_batch
from qwen3_titan_common.data.dataset import RecordStreamDataset, sample_of
from qwen3_titan_common.data.packing import padding_row
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.perf.memory import local_numel
from qwen3_titan_common.perf.progress import Phase

REFERENCE_FILE = "reference_logps.safetensors"
LIVE_REFERENCE_STATE = "dpo_reference"  # the step checkpoints' entry for the live reference's weights
VALIDATION_REFERENCE_FILE = "reference_logps_validation.safetensors"
_FORMAT = "1"


@dataclasses.dataclass(frozen=True)
class ReferenceLogps:
    """Per record of the training data: the reference's summed log-probabilities of chosen and rejected."""

    table_R2: torch.Tensor  # float64, on the CPU
    seen_R: torch.Tensor  # bool: the record was a usable pair (bad records are never trained)
    settings: str = "the data settings"  # what to resume with when a record has no reference
    _on_device: dict = dataclasses.field(default_factory=dict, compare=False)

    def lookup(self, records_P: torch.Tensor) -> torch.Tensor:
        """The (pairs, 2) reference of ``records_P``; a record the reference pass never saw (it was a bad record
        then) is refused rather than given a reference of 0."""
        if records_P.numel() and not bool(self.seen_R[records_P.cpu()].all()):
            missing = records_P.cpu()[~self.seen_R[records_P.cpu()]].tolist()
            raise UserInputError(
                f"records {missing[:5]} of the data have no reference log-probabilities: the reference pass before "
                f"step 1 did not score them; resume with {self.settings} the run started with"
            )
        return self.gather(records_P)

    def gather(self, records_P: torch.Tensor) -> torch.Tensor:
        """:meth:`lookup` without its check, in shapes set by ``records_P``'s alone and nothing read back to the
        host (fixed shapes: a slot without a pair, record -1, gets a value its loss then drops)."""
        device = records_P.device
        if device not in self._on_device:
            self._on_device[device] = self.table_R2.to(device, sum_dtype(device))
        return self._on_device[device][records_P.clamp(min=0)]

    @property
    def pairs(self) -> int:
        return int(self.seen_R.sum())

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        """Written whole or not at all (a temporary file renamed over)."""
        temporary = path.with_name(f".{path.name}.partial")
        tensors = {
            "chosen": self.table_R2[:, 0].contiguous(),
            "rejected": self.table_R2[:, 1].contiguous(),
            "seen": self.seen_R.to(torch.uint8),
        }
        save_file(tensors, str(temporary), metadata={**metadata, "format": _FORMAT})
        os.replace(temporary, path)

    @staticmethod
    def load(path: Path, expected: dict[str, str]) -> ReferenceLogps:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != _FORMAT:
                raise UserInputError(
                    f"{path}: reference log-probabilities of format {metadata.get('format')!r}, this version reads "
                    f"{_FORMAT!r}; resume with the version that wrote them, or use a new --dump_folder"
                )
            found = {key: metadata.get(key) for key in expected}
            if found != expected:
                differs = ", ".join(
                    f"{k} {found[k]!r} (this run: {v!r})" for k, v in expected.items() if found[k] != v
                )
                raise UserInputError(
                    f"{path}: the reference log-probabilities were computed for other data ({differs}); resume with "
                    "the data the run started with, or use a new --dump_folder"
                )
            table = torch.stack([f.get_tensor("chosen"), f.get_tensor("rejected")], dim=1)
            return ReferenceLogps(table, f.get_tensor("seen").bool())


def reference_metadata(dataset: RecordStreamDataset) -> dict[str, str]:
    """What the reference's values depend on beside the starting model: the records, and which of them were
    pairs that fit a row."""
    return {
        "dataset": dataset.source.name,
        "records": str(len(dataset.source)),
        "seq_len": str(dataset.settings.seq_len),
    }


def reference_logps(trainer) -> ReferenceLogps:
    """The training pairs' reference: read back when resuming, else computed now by the model as loaded."""
    dataset: RecordStreamDataset = trainer.dataloader.dataset
    stream = RecordStreamDataset(
        dataset.source,
        dataset.tokens,
        dataclasses.replace(dataset.settings, shuffle=False, infinite=False),
        dp_rank=dataset.dp_rank,
        dp_world_size=dataset.dp_world_size,
        local_batch_size=dataset.local_batch_size,
    )
    # The finite stream ends on a whole group (padding rows complete it): the same batches on every rank.
    batches = _Counted(DataLoader(stream, batch_size=dataset.local_batch_size))
    reference = _read_or_compute(
        trainer, REFERENCE_FILE, stream, batches, "pairs", "the data settings", counted=stream
    )
    steps = trainer.config.training.steps - trainer.step
    read = steps * trainer.gradient_accumulation_steps * trainer.num_pipeline_parallel_microbatches
    if 0 < read < batches.count:
        # A run shorter than an epoch: the pass scored pairs no step will read.
        share = read / batches.count
        logger.info(
            f"[dpo] training reads {read:,} of the {batches.count:,} batches scored ({share:.0%}; {steps:,} "
            f"step{'s' if steps != 1 else ''} to go); --dpo.reference live scores only the pairs the steps read "
            "(docs/preference.md)"
        )
    return reference


class _Counted:
    """An iterable that counts what it hands out."""

    def __init__(self, iterable):
        self.iterable, self.count = iterable, 0

    def __iter__(self):
        for item in self.iterable:
            self.count += 1
            yield item


def live_reference_ready(trainer) -> LiveReference:
    """``--dpo.reference live``, after the checkpoint's load: the weights as loaded become the reference at a
    run's start; a resume read the starting ones back from its step checkpoint."""
    live: LiveReference = trainer.live_reference
    where = "kept in the step checkpoints (a resume reads them)"
    if trainer.step == 0:
        live.freeze_starting_weights()
    else:
        where = f"read back from step {trainer.step}'s checkpoint"
    logger.info(
        f"[dpo] reference: live, the starting values of {len(live.frozen):,} trained tensors "
        f"({live.nbytes / 2**20:,.1f} MiB on this rank) swapped in to score each step's pairs; {where}"
    )
    return live


def validation_reference_logps(trainer) -> ReferenceLogps:
    """The held-out pairs' reference (validation's): computed with the training pairs', from the rows
    validation reads (``Qwen3Validator.batches``), so validation at step 0 would be ln 2 as step 1 is."""
    loader, batches = trainer.validator.batches()
    stream = loader.dataset.stream
    return _read_or_compute(
        trainer,
        VALIDATION_REFERENCE_FILE,
        stream,
        batches,
        "held-out pairs",
        "the --validator.* settings",
        missing="resume with --validator.no-enable (the run started without validation), or ",
    )


def _read_or_compute(
    trainer, name, stream, batches, what, settings, *, counted=None, missing=""
) -> ReferenceLogps:
    """Read back from ``<dump_folder>/<name>`` when resuming, else computed from ``batches`` and saved there;
    ``settings``: the flags a resume must keep for the same pairs; ``counted``: the stream whose identical and
    skipped pairs the line reports; ``missing``: the way out beside a new dump folder when a resume finds no
    file."""
    path = Path(trainer.config.dump_folder) / name
    expected = reference_metadata(stream)
    if trainer.step > 0:
        if not path.is_file():
            way_out = missing + "use a new --dump_folder"
            raise UserInputError(
                f"{path} is missing: a preference run resumed at step {trainer.step} needs the reference "
                f"log-probabilities of its {what} computed before its first step (the weights have moved since); "
                f"{way_out}"
            )
        reference = dataclasses.replace(ReferenceLogps.load(path, expected), settings=settings)
        logger.info(f"[dpo] reference log-probabilities of {reference.pairs:,} {what} read from {path}")
        return reference
    started = time.perf_counter()
    reference = dataclasses.replace(
        _compute(trainer, batches, records=len(stream.source), stream=stream), settings=settings
    )
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        reference.save(path, expected)
    if dist.is_initialized():
        dist.barrier()
    notes = ""
    if counted is not None and counted.identical_pairs:
        notes += f"; {counted.identical_pairs:,} with identical chosen and rejected (no signal)"
    if counted is not None and counted.skipped.count:
        notes += f"; {counted.skipped.count:,} bad record(s) skipped"
    logger.info(
        f"[dpo] reference log-probabilities of {reference.pairs:,} {what} computed by the starting model in "
        f"{time.perf_counter() - started:.1f} s{notes}; kept in {path} (a resume reads them)"
    )
    return reference


def _compute(trainer, batches, *, records: int, stream: RecordStreamDataset) -> ReferenceLogps:
    # One row more: a fixed-shape batch's unused pair slots (record -1) are written there, then dropped.
    dtype = sum_dtype(trainer.device)
    table_R2 = torch.zeros(records + 1, 2, dtype=dtype, device=trainer.device)
    seen_R = torch.zeros(records + 1, dtype=dtype, device=trainer.device)
    with Phase(f"reference log-probabilities of {records:,} records"):
        _score_into(trainer, batches, stream, table_R2, seen_R, mark=1.0)
    # Only the last pipeline stage computed any; each data-parallel rank its own rows.
    dims = trainer.parallel_dims
    for mesh, enabled in (("pp", dims.pp_enabled), ("batch", dims.dp_enabled)):
        if enabled:
            group = dims.get_mesh(mesh).get_group()
            dist.all_reduce(table_R2, group=group)
            dist.all_reduce(seen_R, group=group)
    return ReferenceLogps(table_R2[:records].cpu().double(), seen_R[:records].cpu() > 0)


class LiveReference:
    """``--dpo.reference live``: the starting values of the trained weights, swapped in to score each step's
    pairs (a ``Stateful`` in the step checkpoints, so a resume scores with the starting weights, not the
    resumed ones).

    Why a swap rather than a second model: a second model would have to be built, sharded, pipelined and
    loaded as the trainer builds its own, in every layout and backend; swapping each rank's own shards in and
    out runs the one model already built, and its copy is of the trained weights only (the adapters, with
    LoRA: the frozen base is the same in both)."""

    def __init__(self, model_parts: list[torch.nn.Module]):
        self.model_parts = model_parts
        self.weights: dict[str, torch.nn.Parameter] = {}
        for part in model_parts:
            for name, param in part.named_parameters():
                if param.requires_grad:
                    self.weights[without_checkpoint_wrapper(name).replace("_orig_mod.", "")] = param
        with torch.no_grad():
            self.frozen = {name: param.detach().clone() for name, param in self.weights.items()}
        # Per record of the data (one row more for a fixed-shape batch's unused slots): the step's reference, and
        # the step that scored it.
        self._table_R2: torch.Tensor | None = None
        self._scored_R: torch.Tensor | None = None
        self._step = 0

    @property
    def nbytes(self) -> int:
        """What the copy takes on this rank (its shards)."""
        return sum(local_numel(t) * t.element_size() for t in self.frozen.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.frozen)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in self.frozen.items():
                if state_dict[name] is not tensor:
                    tensor.copy_(state_dict[name])

    def freeze_starting_weights(self) -> None:
        """The weights as loaded (a run's start, not a resume) become the reference's."""
        with torch.no_grad():
            for name, param in self.weights.items():
                self.frozen[name].copy_(param)

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the reference's weights in the body, its own again after (each parameter swapped
        with one temporary the size of the largest)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        """Each trained parameter's values and the reference's exchanged: all of them, or (on an error part
        way) none. FSDP2 computes with an all-gathered copy of each group's shards, which a group that is not
        resharded after its forward (the root; every group under pipeline parallelism) keeps for the next
        forward: every group is resharded first, so that the next forward gathers the values swapped in."""
        from torch.distributed.fsdp import FSDPModule

        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        done: list[str] = []
        try:
            for name in self.weights:
                self._exchange(name)
                done.append(name)
        except BaseException:
            for name in done:
                self._exchange(name)
            raise

    def _exchange(self, name: str) -> None:
        with torch.no_grad():
            param, frozen = self.weights[name], self.frozen[name]
            held = param.detach().clone()
            param.copy_(frozen)
            frozen.copy_(held)

    def score(self, trainer, batches: list) -> None:
        """The reference of the pairs in ``batches`` (a step's, as drawn from the loader, left unchanged), for
        :meth:`lookup` during that step."""
        if self._table_R2 is None:
            records, device = len(trainer.dataloader.dataset.source), trainer.device
            self._table_R2 = torch.zeros(records + 1, 2, dtype=sum_dtype(device), device=device)
            self._scored_R = torch.zeros(records + 1, dtype=torch.int64, device=device)
        self._step += 1
        with self.swapped_in():
            _score_into(
                trainer, batches, trainer.dataloader.dataset, self._table_R2, self._scored_R, mark=self._step
            )

    def lookup(self, records_P: torch.Tensor) -> torch.Tensor:
        """The (pairs, 2) reference of ``records_P``, pairs of this step's batches (a record drawn twice in one
        step has the same reference both times)."""
        if not bool((self._scored_R[records_P] == self._step).all()):
            raise RuntimeError("the live reference did not score every pair of the step")
        return self.gather(records_P)

    def gather(self, records_P: torch.Tensor) -> torch.Tensor:
        """:meth:`lookup` without its check (fixed shapes: nothing read back to the host; an unused slot, record
        -1, reads the extra row, which its loss then drops)."""
        return self._table_R2[torch.where(records_P >= 0, records_P, self._table_R2.shape[0] - 1)]


def _score_into(trainer, batches, stream: RecordStreamDataset, table_R2, seen_R, *, mark) -> None:
    """The model as it is scores the pairs of ``batches``: each pair's summed log-probabilities go to its
    record's row of ``table_R2`` and ``mark`` to ``seen_R`` (the last row takes a fixed-shape batch's unused
    slots, record -1). In eval mode and without gradients (``_through_the_*``), so neither the step's token count
    nor the experts' load of its line (counted by the models and the expert exchange in training forwards
    only) takes this pass in. A pipeline stage before the last finds no pair: it computes no loss."""
    unused = table_R2.shape[0] - 1
    tokens_seen = trainer.ntokens_seen
    if trainer.parallel_dims.pp_enabled:
        found = _through_the_pipeline(trainer, batches, stream)
    else:
        found = _through_the_model(trainer, batches)
    for records_P, sums_P2 in found:
        records_P = torch.where(records_P >= 0, records_P, unused)
        table_R2[records_P] = sums_P2.to(table_R2)
        seen_R[records_P] = mark
    trainer.ntokens_seen = tokens_seen


def _on_device(trainer, input_dict, markers):
    input_dict = {key: value.to(trainer.device) for key, value in input_dict.items()}
    batch = take_preference_batch(input_dict)
    assert batch is not None
    return batch, *trainer.post_dataloading_process(input_dict, markers.to(trainer.device))


@contextlib.contextmanager
def _evaluating(model_parts):
    """The model in eval mode in the body: a reference scores without dropout (LoRA's), as TRL's does."""
    modes = [(module, module.training) for part in model_parts for module in part.modules()]
    for part in model_parts:
        part.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _through_the_model(trainer, batches):
    """Each batch's pairs: records and summed log-probabilities, the model whole on this rank."""
    loss: PreferenceLoss = trainer.loss_fn
    model = trainer.model_parts[0]
    for input_dict, markers in batches:
        batch, inputs, _, extra = _on_device(trainer, input_dict, markers)
        with torch.no_grad(), trainer.train_context(), _evaluating(trainer.model_parts):
            hidden = model(inputs, **extra)
            layout, sums_P2, _ = loss.pair_logps(hidden, batch)
        yield layout.records_P, sums_P2


def _through_the_pipeline(trainer, batches, stream: RecordStreamDataset):
    """The same through the pipeline schedule, its micro-batches a step's (the stream's batches, the last
    group completed with padding rows); on the last stage the loss records what it computes."""
    loss: PreferenceLoss = trainer.loss_fn
    microbatches = trainer.num_pipeline_parallel_microbatches
    padding = sample_of(padding_row(stream.settings.seq_len, stream.tokens.eos_id), preference=True)
    batches = iter(batches)
    while group := list(itertools.islice(batches, microbatches)):
        if len(group) < microbatches:
            rows = group[0][1].shape[0]
            group += [default_collate([padding] * rows)] * (microbatches - len(group))
        arg_mbs, kwarg_mbs, target_mbs = [], [], []
        for input_dict, markers in group:
            batch, inputs, labels, extra = _on_device(trainer, input_dict, markers)
            if trainer.pp_has_last_stage:
                loss.expect(labels, batch)
            arg_mbs.append((inputs,))
            kwarg_mbs.append(extra)
            target_mbs.append(labels)
        with (
            torch.no_grad(),
            trainer.train_context(),
            _evaluating(trainer.model_parts),
            loss.recording() as recorded,
        ):
            trainer.pp_schedule.eval(
                arg_mbs=arg_mbs if trainer.pp_has_first_stage else None,
                kwarg_mbs=kwarg_mbs,
                target_mbs=target_mbs if trainer.pp_has_last_stage else None,
                losses=[] if trainer.pp_has_last_stage else None,
            )
        yield from recorded
