"""The ``--moe.*`` section: Qwen3-MoE's router balance loss, as transformers adds it.

    --moe.router_aux_loss {auto,on,off}    auto (default): on when config.json says
                                           ``output_router_logits: true``, as transformers does
    --moe.router_aux_loss_coef C           the loss's weight (default: config.json's
                                           ``router_aux_loss_coef``, transformers' 0.001 without one)
    --moe.router_aux_loss_scope S          micro_batch (default, transformers' own: each rank's
                                           micro-batch balanced on its own) or global_batch (expert
                                           loads summed over the data-parallel ranks first, as the
                                           Qwen3 report describes)
    --moe.capacity_factor F                with --parallelism.expert_parallel_degree > 1: the fixed-capacity
                                           exchange, F rows per expert from each rank in multiples of a
                                           balanced load (Neuron's, default 2 there; elsewhere the exchange
                                           sends exactly the routed rows unless F is given; models.ep_dispatch)

The loss is :class:`LMLossWithRouterBalance`, torchtitan's cross-entropy with the balance term
(``models.routing``) added to what is differentiated but not to what is reported: the loss torchtitan
logs, validates and checkpoints is the language-model loss alone, so runs with and without the term, and
``eval``, compare directly; the term has its own ``balance:`` figure in the step line and in TensorBoard.

Weighting, for the gradients torchtitan sums over data-parallel ranks and micro-batches: transformers
(with DDP and gradient accumulation) averages ``coef * aux`` over them, and so does this loss. Tokens of
a row's padding (a document with no trained label, ``data.packing``) are not counted, as transformers
leaves out tokens whose ``attention_mask`` is 0; every other token is, prompts included.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
from torchtitan.config import CompileConfig
from torchtitan.tools.logging import logger

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.models.routing import (
    BalanceSums,
    balance_from_sums,
    router_balance_sums,
    take_routing,
)

# transformers' Qwen3MoeConfig defaults, for a config.json that leaves the fields out.
TRANSFORMERS_AUX_LOSS_COEF = 0.001
Scope = Literal["micro_batch", "global_batch"]


@dataclass(kw_only=True, slots=True)
class MoEOptions:
    router_aux_loss: Literal["auto", "on", "off"] = "auto"
    """The router balance loss: auto (as config.json's output_router_logits says), on or off."""

    router_aux_loss_coef: float | None = None
    """Its weight (default: config.json's router_aux_loss_coef, else 0.001)."""

    router_aux_loss_scope: Scope = "micro_batch"
    """micro_batch (transformers') or global_batch (expert loads summed over data-parallel ranks first)."""

    capacity_factor: float | None = None
    """Expert parallelism's fixed capacity per expert, in multiples of a balanced load (default 2 on Neuron;
    >= experts / top_k drops no token). Elsewhere, setting it replaces the exchange of exactly the routed
    rows (torchtitan's on CUDA, ours on the CPU)."""

    def __post_init__(self) -> None:
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not math.isfinite(factor) or factor <= 0):
            raise UserInputError(
                f"--moe.capacity_factor {factor}: expected a positive number (experts / top_k drops no token)"
            )


def counted_tokens(labels_BL: torch.Tensor, positions_BL: torch.Tensor | None) -> torch.Tensor | None:
    """The tokens the balance loss counts: all but a row's padding, the documents with no trained label."""
    if positions_BL is None:
        return None
    document_BL = torch.cumsum(positions_BL == 0, dim=1)
    trained_BL = (labels_BL != IGNORE_INDEX).to(torch.int32)
    rows, length = labels_BL.shape
    trained_per_document = torch.zeros(rows, length + 1, dtype=torch.int32, device=labels_BL.device)
    trained_per_document.scatter_add_(1, document_BL, trained_BL)
    return trained_per_document.gather(1, document_BL) > 0


class LMLossWithRouterBalance(CrossEntropyLoss):
    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        coefficient: float = TRANSFORMERS_AUX_LOSS_COEF
        """Weight of the balance term (transformers' router_aux_loss_coef)."""

        scope: Scope = "micro_batch"
        """Whose expert loads one term balances: each micro-batch's, or the data-parallel batch's."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        super().__init__(config, compile_config=compile_config)
        self.coefficient = config.coefficient
        self.scope = config.scope
        self._model_parts: list[torch.nn.Module] = []
        self._group = None
        self._ranks = 1
        self._microbatches = 1
        self._step_term: torch.Tensor | None = None

    def bind(self, model_parts, *, group, microbatches: int) -> None:
        """The model whose routers it reads, the data-parallel group, micro-batches per step (the trainer's)."""
        self._model_parts = list(model_parts)
        self._group = group
        self._ranks = dist.get_world_size(group) if group is not None else 1
        self._microbatches = microbatches

    def start_step(self) -> None:
        self._step_term = None

    def step_term(self) -> float | None:
        """The balance term of the step just trained, summed over ranks (a collective: every rank calls it)."""
        if self._step_term is None:
            return None
        total = self._step_term.detach().clone()
        if self._group is not None:
            dist.all_reduce(total, group=self._group)
        return float(total)

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        positions = kwargs.get("positions")
        loss, metrics = CrossEntropyLoss.__call__(self, pred, labels, global_valid_tokens)
        if not self._model_parts:
            raise RuntimeError("LMLossWithRouterBalance: called before bind() gave it the model's routers")
        if not self._model_parts[0].training:
            return loss, metrics  # validation: the language-model loss only, as without the term
        records = take_routing(self._model_parts)
        sums = router_balance_sums(records, counted_tokens(labels, positions))
        term = self.coefficient * self._share(sums) / self._microbatches
        detached = term.detach()
        self._step_term = detached if self._step_term is None else self._step_term + detached
        # The value stays the language-model loss (x + 0 is x); the gradient gains the term's.
        return loss + (term - detached), metrics

    def _share(self, sums: BalanceSums) -> torch.Tensor:
        if self.scope == "micro_batch" or self._group is None:
            return balance_from_sums(sums) / self._ranks
        # Loads of the whole data-parallel batch; each rank's probabilities give its share of the product.
        assignments_E = sums.assignments_E.clone()
        rows = sums.rows.clone()
        dist.all_reduce(assignments_E, group=self._group)
        dist.all_reduce(rows, group=self._group)
        return balance_from_sums(BalanceSums(assignments_E, sums.probs_E, rows), local_probs_E=sums.probs_E)


def _coefficient(options: MoEOptions, source: dict, where: str) -> tuple[float, str]:
    if options.router_aux_loss_coef is not None:
        value, named = (
            options.router_aux_loss_coef,
            f"--moe.router_aux_loss_coef {options.router_aux_loss_coef}",
        )
        said = "--moe.router_aux_loss_coef"
    elif "router_aux_loss_coef" in source:
        value, named = (
            source["router_aux_loss_coef"],
            f"{where}: router_aux_loss_coef {source['router_aux_loss_coef']!r}",
        )
        said = "config.json's router_aux_loss_coef"
    else:
        return TRANSFORMERS_AUX_LOSS_COEF, "transformers' default"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise UserInputError(
            f"{named}: expected a positive number (the balance term's weight; --moe.router_aux_loss off "
            "trains without it)"
        )
    return float(value), said


def _named_flags(options: MoEOptions) -> list[str]:
    defaults = MoEOptions()
    return [
        f"--moe.{f.name} {getattr(options, f.name)}"
        for f in dataclasses.fields(MoEOptions)
        if getattr(options, f.name) != getattr(defaults, f.name)
    ]


def loss_with_router_balance(
    loss, options: MoEOptions, *, architecture, parallelism, where: str = "config.json"
):
    """The run's loss section with the balance term where it is on (``loss`` itself where off); one log line
    for an MoE model says which applies and why. A ``--moe`` flag that cannot act is refused. The model then
    records its routing for the term to read (:func:`model_recording_routing`)."""
    flags = _named_flags(options)
    if not architecture.is_moe:
        if flags:
            raise UserInputError(f"{flags[0]}: this model is dense (no experts, no router); drop the flag")
        return loss
    source = dict(architecture.source)
    from_file = source.get("output_router_logits") is True
    on = options.router_aux_loss == "on" or (options.router_aux_loss == "auto" and from_file)
    if not on:
        rest = [f for f in flags if f.startswith("--moe.router_aux_loss_")]
        if rest:
            raise UserInputError(
                f"{rest[0]}: the router balance loss is off for this run; add --moe.router_aux_loss on"
            )
        why = (
            "--moe.router_aux_loss off"
            if options.router_aux_loss == "off"
            else ("as transformers: config.json has no output_router_logits true")
        )
        logger.info(f"[moe] router balance loss off ({why}); --moe.router_aux_loss on adds it")
        return loss
    coefficient, said = _coefficient(options, source, where)
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        if getattr(parallelism, name, 1) > 1:
            raise UserInputError(
                f"--parallelism.{name} {getattr(parallelism, name)}: the router balance loss runs with data "
                "and expert parallelism only; use 1, or --moe.router_aux_loss off"
            )
    why = (
        "--moe.router_aux_loss on"
        if options.router_aux_loss == "on"
        else "config.json's output_router_logits"
    )
    scope = options.router_aux_loss_scope
    logger.info(
        f"[moe] router balance loss on ({why}), coefficient {coefficient:g} ({said}), "
        f"{scope.replace('_', '-')} expert loads; the reported loss is the language-model loss"
    )
    return LMLossWithRouterBalance.Config(
        global_vocab_size=getattr(loss, "global_vocab_size", None),
        coefficient=coefficient,
        scope=scope,
    )


def model_recording_routing(model_config):
    """The model section with each router's choices kept for the balance loss to read (``models.routing``)."""
    with_recording = getattr(model_config, "with_routing_recorded", None)
    if with_recording is None:
        raise UserInputError(
            f"--moe.router_aux_loss: {type(model_config).__qualname__} does not record its routing"
        )
    return with_recording()


def model_with_expert_exchange(
    model_config, options: MoEOptions, *, architecture, parallelism, device_type: str
):
    """The model section with the expert exchange its device runs (``models.ep_dispatch``), said in one log
    line: on CUDA torchtitan's all-to-all, on the CPU ours of exactly the routed rows (gloo runs it; nothing
    is dropped), on Neuron the fixed-capacity one (one shape per layer), and that one wherever
    ``--moe.capacity_factor`` asks for it. A capacity without expert parallelism is refused."""
    from qwen3_titan_common.models.ep_dispatch import DEFAULT_CAPACITY_FACTOR, with_token_dispatcher

    degree = parallelism.expert_parallel_degree
    factor = options.capacity_factor  # a value no one can mean is refused by the section itself
    if degree <= 1:
        if factor is not None:
            raise UserInputError(
                f"--moe.capacity_factor {factor}: only expert parallelism has a capacity; add "
                "--parallelism.expert_parallel_degree N, or drop the flag"
            )
        return model_config
    if not architecture.is_moe:
        return model_config  # refused by train.preflight, which names the degree
    if factor is None and device_type == "cuda":
        logger.info(f"[moe] expert parallel {degree}: torchtitan's all-to-all token exchange")
        return model_config
    if factor is None and device_type != "neuron":
        logger.info(
            f"[moe] expert parallel {degree}: token exchange of exactly the routed rows (none dropped; "
            "--moe.capacity_factor F for Neuron's fixed-capacity exchange)"
        )
    else:
        never = architecture.moe.num_experts / architecture.moe.num_experts_per_tok
        factor = DEFAULT_CAPACITY_FACTOR if factor is None else factor
        logger.info(
            f"[moe] expert parallel {degree}: fixed-capacity token exchange, {factor:g}x a balanced load per "
            f"expert (--moe.capacity_factor; {never:g} or more drops no token); dropped tokens are counted in "
            "the step line"
        )
    return with_token_dispatcher(model_config, factor)
