"""torchtitan's MetricsProcessor with the project's step line and Trainium's peak.

    step: 12/30  loss: 6.01553  grad_norm: 0.97  tps: 4,873  trained: 76%  tflops: 0.14  mfu: n/a  memory: 1.26GiB (host RSS)  eta: 4s
    step: 12/30  loss: 6.01553  balance: 0.00203  grad_norm: 0.97  tps: 4,873  trained: 76%  experts: 31% max, 0 idle  ...

torchtitan's ``log`` still computes and sends every key it knows (``memory/max_reserved(GiB)``,
``memory/num_alloc_retries``, ``time_metrics/data_loading(%)``, ...) to TensorBoard and W&B; this
subclass adds its own keys to them and prints the line above instead of torchtitan's (tools and
tests read it back, ``perf.train_log``). Fields, always in this order: step/total steps, loss, grad norm,
tokens/s per device (every token computed, padding included), the share of those tokens that carried
loss (``trained``: labels not ignored, this rank's rows; Qwen3Trainer counts them), TFLOP/s per device (FLOPs per token as the model config counts them,
``perf.flops``), MFU against the device's peak (torchtitan's table; ``perf.peaks`` for Trainium; n/a
on the CPU and, as in torchtitan, when the run is quantized), peak memory with its source (CUDA
allocator reserved, Neuron device memory, or host RSS on CPU), time left at the pace of the steps after the
first (``perf.run_progress``, which also keeps the figures of the end-of-run summary). TensorBoard is on by
default (``<dump_folder>/tb``).

An MoE run adds the experts' load since the last line: the largest share of a layer's tokens that one
expert took (balanced: top_k / num_experts) and the experts that took none, summed over layers; per
layer in TensorBoard (``moe/layer_N/busiest_share``, ``moe/layer_N/idle_experts``), counted over every
routed token (padding included: the experts computed it) on all data-parallel ranks, for the layers of every
pipeline stage. One warning line
names a layer the first time its routing collapses (:func:`collapsed`). With the router balance loss the
loss is still the language-model loss; ``balance:`` is the term added to it (``components.router_balance``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger

from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.perf.expert_load import all_ranks_counts, collapsed, dropped_assignments, expert_load
from qwen3_titan_common.perf.peaks import peak_flops
from qwen3_titan_common.perf.progress import format_duration
from qwen3_titan_common.perf.run_progress import RunProgress
from qwen3_titan_common.runtime.quiet import titan_log_level_at_least

GIB = 1024**3
MEMORY_SOURCES = {"cuda": "CUDA allocator reserved", "neuron": "Neuron device memory", "cpu": "host RSS"}


def _neuron_peak_memory_bytes() -> int | None:
    try:
        import torch
        import torch_neuronx

        # The Neuron allocator is asynchronous: statistics are only right after a sync.
        torch.neuron.synchronize()
        stats = torch_neuronx.memory_stats()
    except Exception:
        return None
    for key in ("reserved_bytes.all.peak", "allocated_bytes.all.peak", "peak_bytes"):
        if key in stats:
            return int(stats[key])
    return None


class Qwen3Metrics(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        enable_tensorboard: bool = True
        flops_causal_halving: bool = False
        """Halve the attention FLOPs for the causal mask (default: torchtitan's convention, no halving)."""
        progress_seconds: float = 5.0
        """A phase (loading, the first step, a checkpoint save, validation, export) that lasts longer than this
        prints a progress line, then one every this many seconds."""

        def __post_init__(self) -> None:
            if not 0 <= self.progress_seconds < float("inf"):
                raise UserInputError(
                    f"--metrics.progress_seconds {self.progress_seconds}: expected seconds, 0 or more"
                )

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        # The run's config as torchtitan hands it to the metric loggers: the one place it reaches us.
        training = (kwargs.get("config_dict") or {}).get("training") or {}
        self.progress = RunProgress(total_steps=int(training.get("steps") or 0))
        self.device_kind = titan_utils.device_type
        name = str(self.device_memory_monitor.device_name)
        peak, self.peak_source = peak_flops(self.device_kind, name, titan_peak=self.gpu_peak_flops)
        # torchtitan's log divides by this; NaN where there is no peak, so its MFU key says so too.
        self.gpu_peak_flops = peak if peak else math.nan
        self.memory_source = MEMORY_SOURCES.get(self.device_kind, f"{self.device_kind} allocator")
        # This rank's tokens with a label since the last log, beside torchtitan's ntokens_since_last_log.
        self.trained_tokens_since_last_log = 0
        # Set by the trainer when the run has the router balance loss (components.router_balance).
        self.router_balance = None
        # Set by the trainer when the run trains on preference pairs (components.preference).
        self.preference = None
        # Set by the trainer: the file its launcher reads after the run (protocols.summary.RunRecord), which
        # keeps the last step logged, for the line of an interrupted run.
        self.run_record = None
        self._collapsed_layers: set[str] = set()
        logger.info(
            f"[metrics] MFU peak: {self.peak_source}"
            + (f" = {peak / 1e12:.1f} TFLOP/s per rank" if peak else "")
            + f"; attention FLOPs {'halved for causal' if config.flops_causal_halving else 'not halved (dense)'}"
        )

    def _peak_memory_gib(self) -> float:
        if self.device_kind == "neuron":
            peak = _neuron_peak_memory_bytes()
            return -1.0 if peak is None else peak / GIB
        return self.device_memory_monitor.get_peak_stats().max_reserved_gib

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        seconds = time.perf_counter() - self.time_last_log
        global_avg_loss, global_max_loss = self._from_the_last_stage(global_avg_loss, global_max_loss)
        tps = self.ntokens_since_last_log / (seconds * self.parallel_dims.non_data_parallel_size)
        # Each data-parallel rank counts its own rows' tokens; the TP, PP and CP ranks of one row count it each.
        dims = self.parallel_dims
        all_ranks_tokens = self.ntokens_since_last_log * dims.world_size // dims.non_data_parallel_size
        tflops = self.num_flops_per_token * tps / 1e12
        mfu = None
        if not (self.has_quantization or math.isnan(self.gpu_peak_flops)):
            mfu = 100 * tflops * 1e12 / self.gpu_peak_flops
        memory = self._peak_memory_gib()
        trained_share = self.trained_tokens_since_last_log / max(1, self.ntokens_since_last_log)
        self.trained_tokens_since_last_log = 0
        self.progress.record(step, global_avg_loss, all_ranks_tokens, seconds, memory, trained_share)
        if self.run_record is not None:
            self.run_record.last_step = step
            self.run_record.save()
        eta = self.progress.eta_seconds()
        ours = {
            "memory/peak(GiB)": memory,
            "throughput/trained_share": trained_share,
            **(extra_metrics or {}),
        }
        balance = self.router_balance.step_term() if self.router_balance is not None else None
        balance_text = ""
        if balance is not None:
            ours["loss_metrics/router_balance_term"] = balance
            ours["loss_metrics/router_aux_loss"] = balance / self.router_balance.coefficient
            balance_text = f"balance: {balance:.5f}  "
        experts_text = self._expert_load_text(ours)
        pairs = self.preference.step_metrics() if self.preference is not None else None
        pairs_text = ""
        if pairs is not None:
            for name, value in pairs.items():
                ours[f"dpo/{name}"] = value
            pairs_text = f"acc: {100 * pairs['accuracy']:.0f}%  margin: {pairs['margin']:.4f}  "
        # torchtitan's ``log`` prints its own line at INFO; ours replaces it, its metrics stay.
        with titan_log_level_at_least(logging.WARNING):
            super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=ours)
        color = self.color
        mfu_text = f"{mfu:.2f}%" if mfu is not None else "n/a"
        memory_text = f"{memory:.2f}GiB" if memory >= 0 else "n/a"
        total = self.progress.total_steps
        step_text = f"{step:{len(str(total))}}/{total}" if total else f"{step:2}"
        logger.info(
            f"{color.red}step: {step_text}  {color.green}loss: {global_avg_loss:8.5f}  {balance_text}{pairs_text}"
            f"{color.orange}grad_norm: {grad_norm:7.4f}  {color.blue}tps: {round(tps):,}  "
            f"trained: {100 * trained_share:.0f}%  {experts_text}{color.cyan}tflops: {tflops:,.2f}  {color.magenta}mfu: {mfu_text}  "
            f"{color.turquoise}memory: {memory_text} ({self.memory_source})  "
            f"{color.white}eta: {format_duration(eta) if eta is not None else '--'}{color.reset}"
        )

    def _from_the_last_stage(self, avg_loss: float, max_loss: float) -> tuple[float, float]:
        """With pipeline parallelism only the last stage computes the loss (torchtitan logs -1 on the others);
        every rank's line, rank 0's above all, shows the last stage's (a collective over the pipeline)."""
        if not self.parallel_dims.pp_enabled:
            return avg_loss, max_loss
        mesh = self.parallel_dims.get_mesh("pp")
        losses = torch.tensor([avg_loss, max_loss], dtype=torch.float64, device=mesh.device_type)
        dist.all_reduce(losses, op=dist.ReduceOp.MAX, group=mesh.get_group())  # a loss >= 0 beats -1
        avg_loss, max_loss = losses.tolist()
        return avg_loss, max_loss

    def _expert_load_text(self, metrics: dict[str, Any]) -> str:
        """The step line's ``experts:`` figure (empty for a dense model); TensorBoard keys into ``metrics``."""
        counts = all_ranks_counts(self.model_parts, self.parallel_dims)
        if counts is None:
            return ""
        num_experts = next(iter(counts.by_layer.values())).numel()
        loads = expert_load(counts.by_layer, counts.top_k)
        for load in loads:
            metrics[f"moe/layer_{load.layer}/busiest_share"] = load.busiest_share
            metrics[f"moe/layer_{load.layer}/idle_experts"] = load.idle_experts
        fresh = [x for x in loads if collapsed(x, num_experts) and x.layer not in self._collapsed_layers]
        if fresh:
            self._collapsed_layers.update(x.layer for x in fresh)
            what = "; ".join(
                f"layer {x.layer}: {100 * x.busiest_share:.0f}% of its tokens to one expert "
                f"(balanced: {100 * x.balanced_share:.0f}%), {x.idle_experts} of {num_experts} experts idle"
                for x in fresh
            )
            logger.warning(
                f"[moe] routing collapsed in {what}; --moe.router_aux_loss on adds the balance loss (docs/moe.md)"
            )
        busiest = max(x.busiest_share for x in loads)
        idle = sum(x.idle_experts for x in loads)
        dropped = self._dropped_text(metrics)
        return f"experts: {100 * busiest:.0f}% max, {idle} idle{dropped}  "

    def _dropped_text(self, metrics: dict[str, Any]) -> str:
        """``, N dropped`` where a fixed-capacity expert exchange (``models.ep_dispatch``) dropped assignments
        over capacity since the last line, summed over the ranks as the expert loads are; empty where none runs."""
        if not self.parallel_dims.ep_enabled:
            return ""
        dropped, routed = dropped_assignments(self.model_parts, self.parallel_dims)
        if not routed:
            return ""
        metrics["moe/dropped_share"] = dropped / routed
        self.progress.record_dropped(dropped, routed)
        return (
            f", {dropped:,} dropped ({100 * dropped / routed:.1f}%; --moe.capacity_factor)"
            if dropped
            else ", 0 dropped"
        )

    def log_validation(self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None):
        """torchtitan's validation metrics (``validation_metrics/loss``, ...) plus perplexity, and our line::

        validation  step: 10  val_loss: 5.43210  val_ppl: 228.63  tps: 21,845

        Under preference training the held-out pairs' accuracy and margin take the perplexity's place (the
        loss is the preference loss, not a token's)."""
        seconds = time.perf_counter() - self.time_last_log
        loss, _ = self._from_the_last_stage(loss, loss)
        tps = self.ntokens_since_last_log / (seconds * self.parallel_dims.non_data_parallel_size)
        pairs = self.preference.step_metrics() if self.preference is not None else None
        color = self.color
        if pairs is None:
            perplexity = math.exp(loss) if loss < 700 else math.inf
            ours = {"validation_metrics/perplexity": perplexity}
            figures = f"{color.orange}val_ppl: {perplexity:,.2f}  "
        else:
            ours = {f"validation_metrics/dpo_{name}": value for name, value in pairs.items()}
            figures = f"val_acc: {100 * pairs['accuracy']:.0f}%  val_margin: {pairs['margin']:.4f}  "
        ours |= extra_metrics or {}
        with titan_log_level_at_least(logging.WARNING):
            super().log_validation(loss, step, extra_metrics=ours)
        self.trained_tokens_since_last_log = 0  # torchtitan restarted its token count too
        logger.info(
            f"{color.yellow}validation  step: {step:2}  {color.green}val_loss: {loss:8.5f}  "
            f"{figures}{color.blue}tps: {round(tps):,}{color.reset}"
        )
