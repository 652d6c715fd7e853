"""``eval DIR --dataset PAIRS --reference REF``: the DPO loss, accuracy and margin of a model on held-out pairs.

A preference dataset (``chosen``/``rejected``, ``data.preference``) is scored as validation scores it while
training (``components.preference``): per pair, the chosen and rejected completions' summed log-probabilities
under the model and under its reference, the model training started from; the loss is the ``--dpo.*`` loss
averaged over pairs, ``accuracy`` the share of pairs whose chosen reward is above the rejected one's and
``margin`` the mean difference. The rows are validation's (``data.validation``): one pass, packed as for one
rank, each pair whole in a row, the prompt computed once where the model's attention reads continuations.
The two models run one after the other, so only one is in memory at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qwen3_titan_common.components.preference import (
    PairLayout,
    PreferenceOptions,
    preference_losses,
    take_preference_batch,
    target_logps,
)
from qwen3_titan_common.errors import UserInputError


@dataclass(frozen=True)
class PairResult:
    model: str
    loss: float
    accuracy: float  # share of pairs whose chosen reward is above the rejected one's
    margin: float  # mean over pairs of the chosen reward less the rejected one's
    pairs: int
    rows: int  # rows of seq_len run through the model, padding rows included
    tokens_per_second: float  # input tokens (rows x seq_len) through the model per second, both models


@dataclass(frozen=True)
class PairSums:
    """Per record of the data: the chosen and rejected completions' summed log-probabilities and token counts,
    and which records were pairs (the others are never scored)."""

    logps_R2: torch.Tensor
    counts_R2: torch.Tensor
    seen_R: torch.Tensor
    rows: int
    seconds: float


def pair_sums(model: torch.nn.Module, loader, device, max_batches: int | None) -> PairSums:
    """One pass of ``model`` over ``loader``'s rows of pairs (a validation loader: its records are numbered
    by the stream's source)."""
    records = len(loader.dataset.stream.source)
    model = model.to(device)
    logps_R2 = torch.zeros(records, 2, dtype=torch.float64)
    counts_R2 = torch.zeros(records, 2, dtype=torch.float64)
    seen_R = torch.zeros(records, dtype=torch.bool)
    rows = 0
    start = time.perf_counter()
    with torch.no_grad():
        for index, (input_dict, _markers) in enumerate(loader):
            if max_batches is not None and index >= max_batches:
                break
            batch = take_preference_batch(input_dict)
            if batch is None:
                raise UserInputError("eval --reference: the data holds no preference pairs (chosen/rejected)")
            inputs = {k: v.to(device) for k, v in input_dict.items()}
            logits_BLV = model(inputs.pop("input"), **inputs)
            layout = PairLayout.of(batch.targets_BL, batch.positions_BL, batch.records_BL)
            trained = layout.trained_BL.to(device)
            logp_N = target_logps(logits_BLV[trained], batch.targets_BL.to(device)[trained]).double().cpu()
            records_P = layout.records_P
            logps_R2[records_P] = layout.sums(logp_N)
            counts_R2[records_P] = layout.sums(torch.ones_like(logp_N))
            seen_R[records_P] = True
            rows += batch.targets_BL.shape[0]
    seconds = time.perf_counter() - start
    return PairSums(logps_R2, counts_R2, seen_R, rows, seconds)


def score_pairs(
    name: str, policy: PairSums, reference: PairSums, options: PreferenceOptions, seq_len: int
) -> PairResult:
    """The preference loss and metrics of ``policy`` against ``reference`` over the pairs both scored."""
    seen = policy.seen_R & reference.seen_R
    pairs = int(seen.sum())
    if pairs == 0:
        raise UserInputError(f"{name}: the evaluation data holds no pair to score")
    losses_P, stats_P4 = preference_losses(
        policy.logps_R2[seen], reference.logps_R2[seen], policy.counts_R2[seen], options
    )
    seconds = policy.seconds + reference.seconds
    return PairResult(
        model=name,
        loss=float(losses_P.sum()) / pairs,
        accuracy=float(stats_P4[:, 0].sum()) / pairs,
        margin=float(stats_P4[:, 1].sum()) / pairs,
        pairs=pairs,
        rows=policy.rows,
        tokens_per_second=(policy.rows + reference.rows) * seq_len / seconds,
    )


def pairs_table(report: dict) -> list[str]:
    lines = [
        f"reference: {report['reference']}; {report['dpo']}",
        "",
        "| model | loss | accuracy | margin | pairs | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['model']} | {r['loss']:.5f} | {100 * r['accuracy']:.1f}% | {r['margin']:.4f} | {r['pairs']:,} "
            f"| {r['tokens_per_second']:,.0f} |"
        )
    return lines
