"""Preference training (``--objective dpo``): the ``--dpo.*`` section and the DPO loss.

    --objective dpo              train on preference pairs (``data.preference``) instead of next tokens
    --dpo.beta B                 the DPO temperature (default 0.1, TRL's)
    --dpo.loss_type T            sigmoid (default, DPO) or ipo
    --dpo.label_smoothing S      sigmoid only: the chance a pair's labels are swapped (cDPO; default 0)
    --dpo.sft_weight W           adds W x the chosen completion's mean token NLL per pair (default 0)
    --dpo.share_prompt M         auto (default: where the attention is ours, block-sparse), on or off: a packed
                                 pair's prompt computed once, the rejected completion continuing it
    --dpo.reference R            precomputed (default: the starting model scores every pair once, before
                                 step 1) or live (a frozen copy of the starting weights scores each step's
                                 pairs; ``train.preference``)
    --dpo.fixed_shapes M         auto (default: on on Neuron), on or off: every tensor of the loss shaped by
                                 the batch's rows alone, not by its pairs (Neuron compiles a graph per shape)

Per pair, with ``pi_c``/``pi_r`` the policy's summed log-probabilities of the chosen and rejected
completions' tokens and ``ref_c``/``ref_r`` the reference model's, ``h = (pi_c - ref_c) - (pi_r - ref_r)``:

- sigmoid: ``-(1 - s) log sigmoid(beta h) - s log sigmoid(-beta h)``;
- ipo: ``(h - 1 / (2 beta))^2`` with each log-probability averaged over its completion's tokens (as TRL
  computes IPO).

The loss is the mean over the global batch's pairs: the rows' labels mark one token per pair
(``data.preference.pair_markers``), so torchtitan's own count of valid labels, over data-parallel ranks and
micro-batches, is the number of pairs it divides by. The step line's ``loss:`` is that mean; ``acc:`` is the
share of pairs whose chosen reward is above the rejected one's, ``margin:`` the mean difference of the two,
a reward being ``beta (pi - ref)`` of summed log-probabilities whatever the loss (TRL's
``rewards/accuracies`` and ``rewards/margins``, IPO included); TensorBoard also gets the mean rewards of the
chosen and rejected completions.

How the gradient is computed without whole logits: DPO's loss is not a sum over tokens, so torchtitan's
chunked loss cannot compute it chunk by chunk directly. A first pass computes every trained token's
log-probability without gradients (chunk by chunk); the pairs' losses then give each token's weight,
``dL/dlog p``, and the second pass is torchtitan's :class:`ChunkedLossWrapper` on the weighted token NLL,
whose gradient is exactly the DPO loss's. Both passes see only the completions' tokens (the trained positions).

With fixed shapes (``--dpo.fixed_shapes``, on by default on Neuron, which compiles one graph per input shape) no
tensor's shape depends on the batch's pairs: both passes run on every token of the rows (the untrained ones with
weight 0), a batch has ``B * L / 2`` pair slots (a pair has at least two completion tokens) of which ``valid_P``
marks the used ones, and nothing is read back to the host during the step. The projection then also runs on the
prompts' tokens: the price of one graph for every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss, compute_logprobs
from torchtitan.config import CompileConfig
from torchtitan.distributed.spmd_types import spmd_mesh_size

from qwen3_titan_common.components.loss import TrainedTokenLoss
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.models.context_parallel import local_token_index
from qwen3_titan_common.models.document_blocks import segment_starts
from qwen3_titan_common.perf.precision import compute_autocast

Objective = Literal["sft", "dpo"]
LossType = Literal["sigmoid", "ipo"]
# Input keys a row of preference pairs carries beside the model's own (``data.dataset.sample_of``).
TARGETS_KEY, RECORDS_KEY = "dpo_targets", "dpo_records"


@dataclass(kw_only=True, slots=True)
class PreferenceOptions:
    beta: float = 0.1
    """The DPO temperature: how far the policy's log-ratios are scaled (TRL's default 0.1)."""

    loss_type: LossType = "sigmoid"
    """sigmoid (DPO) or ipo."""

    label_smoothing: float = 0.0
    """sigmoid only: the assumed chance that a pair's chosen and rejected are swapped (cDPO), in [0, 0.5)."""

    sft_weight: float = 0.0
    """Weight of an added SFT term: the chosen completion's mean token NLL, averaged over pairs (0: none)."""

    share_prompt: Literal["auto", "on", "off"] = "auto"
    """Packed pairs compute their prompt once, the rejected completion continuing it (auto: where the model's
    attention is the block-sparse per-document one, which reads continuations; off: each completion with its
    own copy of the prompt)."""

    reference: Literal["precomputed", "live"] = "precomputed"
    """Where the reference log-probabilities come from: precomputed (the starting model scores every training
    pair once before step 1, kept with the run) or live (a frozen copy of the starting values of the trained
    weights, swapped in to score each step's pairs before its forward: one more forward per step, one more copy
    of the trained weights in memory; with LoRA only the adapters are copied)."""

    fixed_shapes: Literal["auto", "on", "off"] = "auto"
    """Every tensor of the loss shaped by the batch's rows alone, not by its pairs and completion tokens (auto: on
    on Neuron, which compiles a graph per input shape; off elsewhere, where the output projection then runs on the
    completions' tokens only)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise UserInputError(f"--dpo.beta {self.beta}: expected a positive number (TRL's default is 0.1)")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise UserInputError(
                f"--dpo.label_smoothing {self.label_smoothing}: expected a chance in [0, 0.5) that a pair's labels "
                "are swapped (0.5 would make every pair carry no signal)"
            )
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise UserInputError(
                f"--dpo.label_smoothing {self.label_smoothing}: label smoothing is the sigmoid loss's (cDPO), not "
                f"--dpo.loss_type {self.loss_type}'s"
            )
        if not (math.isfinite(self.sft_weight) and self.sft_weight >= 0):
            raise UserInputError(f"--dpo.sft_weight {self.sft_weight}: expected a weight >= 0")

    def describe(self) -> str:
        text = f"{self.loss_type} loss, beta {self.beta:g}"
        if self.label_smoothing:
            text += f", label smoothing {self.label_smoothing:g}"
        if self.sft_weight:
            text += f", + {self.sft_weight:g} x chosen NLL"
        return text

    def describe_reference(self) -> str:
        if self.reference == "live":
            return "the starting model, live (a frozen copy scores each step's pairs)"
        return "the starting model, precomputed before step 1"


@dataclass(frozen=True)
class PairLayout:
    """Where a batch's pairs are: per trained token, its pair and side (0 chosen, 1 rejected).

    In a row of pairs the sequences holding trained tokens come chosen, rejected, chosen, ...; a sequence
    starts where the positions do not go on from the token before: a restart at 0, or a rejected completion
    continuing its prompt (``data.preference``)."""

    trained_BL: torch.Tensor
    pair_N: torch.Tensor
    side_N: torch.Tensor
    records_P: torch.Tensor
    pairs: int
    valid_P: torch.Tensor | None = None
    """Fixed shapes (:meth:`fixed`): which of the ``pairs`` slots hold a pair; None: every one does."""

    @staticmethod
    def of(targets_BL: torch.Tensor, positions_BL: torch.Tensor, records_BL: torch.Tensor) -> PairLayout:
        trained_BL = targets_BL != IGNORE_INDEX
        # Numbered over the whole batch: a row's last sequence and the next row's first are two.
        sequence_BL = torch.cumsum(segment_starts(positions_BL).reshape(-1).to(torch.int64), 0)
        sequence_N = sequence_BL.reshape(targets_BL.shape)[trained_BL]
        starts_N = torch.ones_like(sequence_N, dtype=torch.bool)
        starts_N[1:] = sequence_N[1:] != sequence_N[:-1]
        order_N = torch.cumsum(starts_N.to(torch.int64), 0) - 1
        sequences = int(order_N[-1]) + 1 if order_N.numel() else 0
        if sequences % 2:
            raise RuntimeError(
                f"a batch of preference rows holds {sequences} trained sequences, not whole pairs"
            )
        records_P = records_BL[trained_BL][starts_N][0::2]
        return PairLayout(trained_BL, order_N // 2, order_N % 2, records_P, sequences // 2)

    @staticmethod
    def fixed(targets_BL: torch.Tensor, positions_BL: torch.Tensor, records_BL: torch.Tensor) -> PairLayout:
        """The same layout in shapes set by ``(B, L)`` alone: ``pair_N``/``side_N`` for every token of the rows
        (row-major; an untrained token's are slot 0's, weighed 0), ``B * L // 2`` pair slots, ``records_P`` -1 in
        an unused slot, and no value read back to the host."""
        trained_BL = targets_BL != IGNORE_INDEX
        tokens = targets_BL.numel()
        sequence_N = torch.cumsum(segment_starts(positions_BL).reshape(-1).to(torch.int64), 0) - 1
        trained_N = trained_BL.reshape(-1)
        # Each sequence's rank among the sequences holding trained tokens: chosen, rejected, chosen, ...
        holds_S = torch.zeros(tokens, dtype=torch.int64, device=targets_BL.device)
        holds_S = holds_S.index_add(0, sequence_N, trained_N.to(torch.int64)).clamp(max=1)
        order_N = (torch.cumsum(holds_S, 0) - 1)[sequence_N]
        pair_N = torch.where(trained_N, order_N // 2, 0)
        side_N = torch.where(trained_N, order_N % 2, 0)
        slots = max(1, tokens // 2)
        unused = torch.full((slots,), -1, dtype=records_BL.dtype, device=records_BL.device)
        marked_N = torch.where(trained_N, records_BL.reshape(-1), -1)
        records_P = unused.scatter_reduce(0, pair_N, marked_N, reduce="amax")
        return PairLayout(trained_BL, pair_N, side_N, records_P, slots, valid_P=records_P >= 0)

    def sums(
        self, values_N: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Per pair, the chosen and the rejected completion's sum of ``values_N``: (pairs, 2). ``at``: the
        pair and side of each value where they are some of the tokens only (a context-parallel rank's)."""
        pair_n, side_n = at if at is not None else (self.pair_N, self.side_N)
        out = values_N.new_zeros(self.pairs, 2)
        return out.index_put((pair_n, side_n), values_N, accumulate=True)


@dataclass(frozen=True)
class _Completions:
    """The completion tokens of a batch of pairs a rank computes, with their pair and side."""

    layout: PairLayout
    hidden_ND: torch.Tensor
    targets_N: torch.Tensor
    pair_n: torch.Tensor
    side_n: torch.Tensor
    trained_n: torch.Tensor | None = None  # fixed shapes: which of the tokens train (None: all of them)


@dataclass(frozen=True)
class PreferenceBatch:
    """What the trainer takes out of a row of pairs for the loss: token targets and their records."""

    targets_BL: torch.Tensor
    records_BL: torch.Tensor
    positions_BL: torch.Tensor


def sum_dtype(device: torch.device) -> torch.dtype:
    """What a pair's summed log-probabilities are kept in: float64, except on a device without it (Neuron's)."""
    return torch.float64 if device.type in ("cpu", "cuda", "meta") else torch.float32


def take_preference_batch(input_dict: dict[str, torch.Tensor]) -> PreferenceBatch | None:
    """The preference inputs, popped from ``input_dict`` (the model does not take them); None in other rows."""
    if TARGETS_KEY not in input_dict:
        return None
    return PreferenceBatch(input_dict.pop(TARGETS_KEY), input_dict.pop(RECORDS_KEY), input_dict["positions"])


def preference_losses(
    policy_P2: torch.Tensor, reference_P2: torch.Tensor, counts_P2: torch.Tensor, options: PreferenceOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair: the loss, and ``[h > 0, beta h, reward chosen, reward rejected]`` (detached) for the metrics."""
    if options.loss_type == "ipo":
        policy, reference = policy_P2 / counts_P2, reference_P2 / counts_P2
    else:
        policy, reference = policy_P2, reference_P2
    ratio_P2 = policy - reference
    h_P = ratio_P2[:, 0] - ratio_P2[:, 1]
    beta = options.beta
    if options.loss_type == "ipo":
        losses_P = (h_P - 1 / (2 * beta)) ** 2
    else:
        smoothing = options.label_smoothing
        losses_P = -(1 - smoothing) * F.logsigmoid(beta * h_P) - smoothing * F.logsigmoid(-beta * h_P)
    if options.sft_weight:
        losses_P = losses_P - options.sft_weight * policy_P2[:, 0] / counts_P2[:, 0]
    # The rewards are beta times the summed log-ratios whatever the loss (as TRL logs them, IPO included).
    rewards_P2 = beta * (policy_P2 - reference_P2).detach()
    margin_P = rewards_P2[:, 0] - rewards_P2[:, 1]
    stats_P4 = torch.stack(
        [(margin_P > 0).to(margin_P.dtype), margin_P, rewards_P2[:, 0], rewards_P2[:, 1]], dim=1
    )
    return losses_P, stats_P4


def target_logps(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability of its target (0 for an ignored one), in fp32 at least (fp64 kept: the
    exactness tests compute in it). Under tensor parallelism a rank holds a slice of the vocabulary, which
    torchtitan's ``compute_logprobs`` gathers (its gradient the slice back) for the chunk's few rows."""
    if spmd_mesh_size("tp") > 1 or isinstance(logits_NV, DTensor):
        return compute_logprobs(logits_NV[None], targets_N[None])[0]
    logits_NV = logits_NV if logits_NV.dtype == torch.float64 else logits_NV.float()
    return -F.cross_entropy(logits_NV, targets_N, reduction="none", ignore_index=IGNORE_INDEX)


class WeightedTokenNLL(BaseLoss):
    """Sum over tokens of ``weights x`` cross-entropy: the second pass of :class:`PreferenceLoss`, whose
    gradient is the DPO loss's once the weights are ``-dL/dlog p``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        pass

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        del config, compile_config

    def __call__(self, pred, labels, global_valid_tokens=None, weights=None, **kwargs):
        logps = target_logps(pred.flatten(0, -2), labels.reshape(-1))
        return -(logps * weights.reshape(-1)).sum(), {}


class PreferenceLoss(TrainedTokenLoss):
    """The DPO loss of a batch of pairs (see the module docstring), over their completions' tokens only."""

    @dataclass(kw_only=True, slots=True)
    class Config(TrainedTokenLoss.Config):
        loss_fn: BaseLoss.Config = field(default_factory=WeightedTokenNLL.Config)
        options: PreferenceOptions = field(default_factory=PreferenceOptions)
        chunk_tokens: int = 128
        """Completion tokens per chunk of the output projection: what bounds the logits held at once (at
        Qwen3's 151,936-token vocabulary, 78 MB in fp32 a buffer), whatever the batch's pairs."""
        fixed_shapes: bool = False
        """Every tensor shaped by the rows alone (the module docstring); set from --dpo.fixed_shapes."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        super().__init__(config, compile_config=compile_config)
        self.options = config.options
        self.chunk_tokens = config.chunk_tokens
        self.fixed_shapes = config.fixed_shapes
        self.reference = None  # train.preference.ReferenceLogps, set before the first step
        # The labels of the loss's next calls, each with its batch: one, or a step's micro-batches.
        self._expected: list[tuple[torch.Tensor, PreferenceBatch]] = []
        self._recorded: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Per step, summed over its micro-batches: [loss, acc, beta h, reward c, reward r, pairs].
        self._stats: torch.Tensor | None = None
        self._group = None
        self._context = None
        self._pipeline = None
        self._pipeline_device = None

    def bind(self, group, context=None, pipeline=None, device=None) -> None:
        """The data-parallel group the step's metrics are summed over (None: one rank), the context-parallel
        group whose ranks each hold a share of every row, and the pipeline group whose last stage alone computes
        the loss (None: none), whose collectives run on ``device``."""
        self._group = group
        self._context = context
        self._pipeline = pipeline
        self._pipeline_device = device

    def expect(self, labels: torch.Tensor, batch: PreferenceBatch | None) -> None:
        """The pairs of the loss's call on ``labels`` (the tensor the trainer hands it): one call per
        micro-batch, in whatever order a pipeline schedule's last stage makes them."""
        if batch is None:
            raise RuntimeError("PreferenceLoss: a batch without preference pairs")
        self._expected.append((labels, batch))

    def _batch_for(self, labels: torch.Tensor) -> tuple[PreferenceBatch, bool]:
        """The batch expected for ``labels``, and whether this call counts. torch's pipeline stages call the
        loss once more before their first backward, on the first micro-batch's labels detached (to infer the
        gradients' shapes; the gradients it makes are cleared): that call is computed alike and not counted."""
        for index, (expected, batch) in enumerate(self._expected):
            if expected is labels:
                del self._expected[index]
                return batch, True
        for expected, batch in self._expected:
            if expected.data_ptr() == labels.data_ptr() and expected.shape == labels.shape:
                return batch, False
        raise RuntimeError("PreferenceLoss: called without the batch's pairs (Qwen3Trainer expects them)")

    @contextlib.contextmanager
    def recording(self):
        """The reference pass through a pipeline schedule: each call records its pairs' records and summed
        log-probabilities (into the list yielded) instead of computing a loss."""
        self._recorded = []
        try:
            yield self._recorded
        finally:
            self._recorded = None

    def start_step(self) -> None:
        self._stats = None

    @contextlib.contextmanager
    def held_out(self, reference):
        """Validation on held-out pairs: their own reference (``train.preference``) and their own metrics,
        the training step's kept aside meanwhile."""
        kept = self.reference, self._stats
        self.reference, self._stats = reference, None
        try:
            yield
        finally:
            self.reference, self._stats = kept

    def step_metrics(self) -> dict[str, float] | None:
        """The step's pair metrics over every data-parallel rank (a collective: every rank calls it)."""
        stats = self._stats
        if stats is None:
            if self._pipeline is None:
                return None
            stats = torch.zeros(6, dtype=sum_dtype(self._pipeline_device), device=self._pipeline_device)
        total = stats.detach().clone()
        # Under pipeline parallelism only the last stage holds any: summed over the pipeline first.
        for group in (self._pipeline, self._group):
            if group is not None:
                dist.all_reduce(total, group=group)
        pairs = float(total[-1])
        if pairs == 0:
            return None
        names = ("loss", "accuracy", "margin", "reward_chosen", "reward_rejected")
        means = {name: float(value) / pairs for name, value in zip(names, total[:-1], strict=True)}
        return means | {"pairs": float(total[-1])}

    def token_logps(self, hidden_ND: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        """Each token's log-probability under the output projection, chunk by chunk, without gradients."""
        from torch.distributed.fsdp import FSDPModule

        lm_head = self.lm_head
        assert lm_head is not None, "PreferenceLoss: lm_head not set"
        rows = self.chunk_tokens
        pieces = []
        sharded = isinstance(lm_head, FSDPModule)
        if sharded:
            # One all-gather for every chunk (the chunks' count differs between ranks), as torchtitan's chunked
            # loss keeps it unsharded across its chunks.
            lm_head.set_reshard_after_forward(False)
            lm_head.unshard()
        try:
            with torch.no_grad(), compute_autocast(self.compute_dtype):
                for h_ND, t_N in zip(hidden_ND.split(rows), targets_N.split(rows), strict=True):
                    pieces.append(target_logps(lm_head(h_ND), t_N))
        finally:
            if sharded:
                lm_head.set_reshard_after_forward(True)
                lm_head.reshard()
        return torch.cat(pieces) if pieces else hidden_ND.new_zeros(0)

    def pair_logps(
        self, hidden_BLD: torch.Tensor, batch: PreferenceBatch
    ) -> tuple[PairLayout, torch.Tensor, torch.Tensor]:
        """The layout of the batch's pairs, their summed completion log-probabilities and token counts."""
        completions = self._completions(hidden_BLD, batch)
        return (completions.layout, *self._sums(completions))

    def _layout(self, batch: PreferenceBatch) -> PairLayout:
        build = PairLayout.fixed if self.fixed_shapes else PairLayout.of
        return build(batch.targets_BL, batch.positions_BL, batch.records_BL)

    def _completions(self, hidden_BLD: torch.Tensor, batch: PreferenceBatch) -> _Completions:
        """The pairs' layout, and this rank's completion tokens: their hidden states, targets, pairs and sides.

        Under context parallelism the batch is the whole rows (every CP rank has them) and ``hidden_BLD`` this
        rank's share of their tokens (``models.context_parallel``): the layout is the rows', the tokens the
        share's."""
        layout = self._layout(batch)
        trained_BL, targets_BL = layout.trained_BL, batch.targets_BL
        if self.fixed_shapes:
            # Every token of the rows (this CP rank's share of them), the untrained ones' targets made 0 so that
            # any vocabulary slice can gather them; their weight is 0.
            targets_BL = torch.where(trained_BL, targets_BL, 0)
            pair_BL, side_BL = layout.pair_N.view(trained_BL.shape), layout.side_N.view(trained_BL.shape)
            if self._context is not None:
                group = self._context
                index = local_token_index(
                    targets_BL.shape[1],
                    dist.get_world_size(group),
                    dist.get_rank(group),
                    device=targets_BL.device,
                )
                targets_BL, pair_BL, side_BL = targets_BL[:, index], pair_BL[:, index], side_BL[:, index]
                trained_BL = trained_BL[:, index]
            return _Completions(
                layout,
                hidden_BLD.reshape(-1, hidden_BLD.shape[-1]),
                targets_BL.reshape(-1),
                pair_BL.reshape(-1),
                side_BL.reshape(-1),
                trained_BL.reshape(-1),
            )
        if self._context is None:
            return _Completions(
                layout, hidden_BLD[trained_BL], targets_BL[trained_BL], layout.pair_N, layout.side_N
            )
        group = self._context
        index = local_token_index(
            targets_BL.shape[1], dist.get_world_size(group), dist.get_rank(group), device=targets_BL.device
        )
        # Each trained token's number in the rows' order, then this rank's tokens in its own order.
        token_BL = (torch.cumsum(trained_BL.reshape(-1).to(torch.int64), 0) - 1).reshape(trained_BL.shape)
        mine_BL = trained_BL[:, index]
        token_n = token_BL[:, index][mine_BL]
        return _Completions(
            layout,
            hidden_BLD[mine_BL],
            targets_BL[:, index][mine_BL],
            layout.pair_N[token_n],
            layout.side_N[token_n],
        )

    def _sums(self, completions: _Completions):
        """Per pair, the summed completion log-probabilities (float64, no gradient; over the CP group's shares
        of the rows) and token counts."""
        layout = completions.layout
        dtype = sum_dtype(completions.targets_N.device)
        logp_n = self.token_logps(completions.hidden_ND.detach(), completions.targets_N).to(dtype)
        if completions.trained_n is not None:  # fixed shapes: every token, the untrained ones counted 0
            logp_n = logp_n * completions.trained_n.to(dtype)
        sums_P2 = layout.sums(logp_n, at=(completions.pair_n, completions.side_n))
        if self._context is not None:
            dist.all_reduce(sums_P2, group=self._context)
        # Over the whole rows' tokens as the layout numbers them: its trained ones (fixed shapes: every token).
        if layout.valid_P is None:
            trained_N = torch.ones(layout.pair_N.shape, dtype=dtype, device=logp_n.device)
        else:
            trained_N = layout.trained_BL.reshape(-1).to(dtype)
        counts_P2 = layout.sums(trained_N)
        return sums_P2, counts_P2

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, counted = self._batch_for(labels)
        if self._recorded is not None:
            if counted:
                layout, sums_P2, _ = self.pair_logps(pred, batch)
                self._recorded.append((layout.records_P, sums_P2))
            return pred.new_zeros(()), {}
        if self.reference is None:
            raise RuntimeError("PreferenceLoss: called before the reference log-probabilities were set")
        completions = self._completions(pred, batch)
        layout, hidden_ND, targets_N = completions.layout, completions.hidden_ND, completions.targets_N
        policy_P2, counts_P2 = self._sums(completions)
        policy_P2.requires_grad_(True)
        valid_P = layout.valid_P
        if valid_P is None:
            reference_P2 = self.reference.lookup(layout.records_P).to(policy_P2)
        else:
            # An unused slot's count is made 1 (IPO divides by it) and its loss and metrics 0.
            reference_P2 = self.reference.gather(layout.records_P).to(policy_P2)
            counts_P2 = counts_P2.clamp(min=1)
        with torch.enable_grad():
            losses_P, stats_P4 = preference_losses(policy_P2, reference_P2, counts_P2, self.options)
            if valid_P is not None:
                losses_P = losses_P * valid_P
                stats_P4 = stats_P4 * valid_P[:, None]
            # Without a divisor (validation), the sum over pairs: its caller divides by the pairs of every rank.
            value = losses_P.sum() / (global_valid_tokens if global_valid_tokens is not None else 1)
        if counted:
            pairs = layout.pairs if valid_P is None else valid_P.sum()
            self._keep_stats(losses_P.detach(), stats_P4, pairs)
        # Every CP rank computes every pair's loss; the loss mesh (batch x cp) sums one share from each.
        shares = dist.get_world_size(self._context) if self._context is not None else 1
        reported = value.detach().float() / shares
        if not pred.requires_grad:
            return reported, {}
        # Rows of padding only (the end of a finite run) take the same path: no token, padded to one chunk of
        # ignored rows, so every rank runs the output projection's collectives alike.
        (grad_P2,) = torch.autograd.grad(value, policy_P2)
        # The gradient of each token this rank holds: its pair's whole (each token is on one CP rank).
        weights_N = -grad_P2[completions.pair_n, completions.side_n].to(
            torch.promote_types(pred.dtype, torch.float32)
        )
        if completions.trained_n is not None:
            weights_N = weights_N * completions.trained_n
        # torchtitan's chunked loss splits into equal chunks: as many as keep each within chunk_tokens.
        self.num_chunks = max(1, -(-targets_N.numel() // self.chunk_tokens))
        padded = max(1, -(-targets_N.numel() // self.num_chunks)) * self.num_chunks
        weights = torch.cat([weights_N, weights_N.new_zeros(padded - weights_N.numel())])[None]
        surrogate, _ = self._chunked_loss(hidden_ND, targets_N, None, weights=weights)
        return reported + (surrogate - surrogate.detach()), {}

    def _keep_stats(self, losses_P: torch.Tensor, stats_P4: torch.Tensor, pairs: int | torch.Tensor) -> None:
        count = torch.as_tensor(pairs, dtype=losses_P.dtype, device=losses_P.device).reshape(1)
        sums = torch.cat([losses_P.sum()[None], stats_P4.sum(0), count]).to(sum_dtype(losses_P.device))
        self._stats = sums if self._stats is None else self._stats + sums


def loss_and_data_for_preference(
    loss,
    dataloader,
    options: PreferenceOptions,
    *,
    objective: str,
    moe,
    parallelism,
    model_config,
    device_type: str,
):
    """The loss and data sections of a preference run where ``--objective dpo`` asks for one (both as they are
    otherwise): the DPO loss, and the pairs' prompt shared in the rows where the model can read that. What
    preference training does not run with yet is refused in one line."""
    from torchtitan.tools.logging import logger

    from qwen3_titan_common.models.attention import uses_document_blocks

    if objective != "dpo":
        return loss, dataloader
    fixed = options.fixed_shapes == "on" or (options.fixed_shapes == "auto" and device_type == "neuron")
    if device_type == "neuron" and not fixed:
        raise UserInputError(
            "--dpo.fixed_shapes off: the loss would select each batch's completion tokens, a shape Neuron compiles "
            "a graph for at every step; use auto or on on Neuron (docs/preference.md)"
        )
    degree = parallelism.context_parallel_degree
    if degree > 1 and not uses_document_blocks(model_config):
        # A pair's tokens are found on the CP ranks by our split of the rows (models.context_parallel).
        raise UserInputError(
            f"--parallelism.context_parallel_degree {degree}: --objective dpo shares rows over context-parallel "
            "ranks with the block-sparse per-document attention only (the CPU's), not this model's (torchtitan's "
            "Flex or varlen, as on CUDA, whose context parallelism splits rows its own way); use 1 "
            "(docs/preference.md)"
        )
    if moe.router_aux_loss == "on" or moe.router_aux_loss_coef is not None:
        flag = "--moe.router_aux_loss on" if moe.router_aux_loss == "on" else "--moe.router_aux_loss_coef"
        raise UserInputError(
            f"{flag}: the router balance loss is not added to the preference loss; drop the flag with --objective dpo"
        )
    from qwen3_titan_common.components.router_balance import LMLossWithRouterBalance

    if isinstance(loss, LMLossWithRouterBalance.Config):
        logger.info(
            "[dpo] the router balance loss config.json asks for is not added to the preference loss "
            "(--moe.router_aux_loss off says so)"
        )
    dataloader = _with_prompt_layout(dataloader, options.share_prompt, uses_document_blocks(model_config))
    shared = getattr(dataloader, "share_prompt", False)
    layout = "prompt computed once per pair" if shared else "each completion with its own copy of the prompt"
    if fixed:
        layout += "; fixed shapes (every token of the rows projected, B x L / 2 pair slots)"
    logger.info(f"[dpo] preference training: {options.describe()}; {layout} (--dpo.*)")
    return PreferenceLoss.Config(options=options, fixed_shapes=fixed), dataloader


def _with_prompt_layout(loader, asked: str, readable: bool):
    """The loader section with the pairs' prompt shared where ``--dpo.share_prompt`` (``asked``) and the model's
    attention (``readable``: ours, which reads a completion continuing its prompt) allow."""
    if not hasattr(loader, "share_prompt") or asked == "off":
        return loader
    if asked == "on" and not readable:
        raise UserInputError(
            "--dpo.share_prompt on: this model's attention (torchtitan's Flex or varlen, or transformers' SDPA mask) "
            "knows documents only, not a completion that continues a prompt; use the block-sparse attention, or "
            "--dpo.share_prompt off"
        )
    if not readable:
        return loader
    if not loader.packing:
        if asked == "on":
            raise UserInputError(
                "--dpo.share_prompt on: --dataloader.no-packing puts one pair per row as two sequences; drop one"
            )
        return loader
    return dataclasses.replace(loader, share_prompt=True)
