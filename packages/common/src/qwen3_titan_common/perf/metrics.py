"""torchtitan's MetricsProcessor with our throughput convention and a fixed log line.

    step: 12  loss: 6.01553  grad_norm: 0.97  tps: 4,873  tflops: 0.14  mfu: n/a  memory: 1.26GiB (host RSS)

Fields, always in this order: step, loss, grad norm, tokens/s per device, TFLOP/s per
device (FLOPs per token from :mod:`flops`, causal halving as configured), MFU against
:mod:`peaks` (n/a where no peak is defined, e.g. CPU), peak memory with its source
(CUDA allocator reserved, Neuron device memory, or host RSS on CPU). TensorBoard is on
by default (``<dump_folder>/tb``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger

from qwen3_titan_common.perf.peaks import peak_flops

GIB = 1024**3


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

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        device_type = titan_utils.device_type
        self.device_kind = "neuron" if device_type == "neuron" else device_type
        name = self.device_memory_monitor.device_name
        self.peak_flops_per_rank, self.peak_source = peak_flops(self.device_kind, str(name))
        self.memory_source = {
            "cuda": "CUDA allocator reserved",
            "neuron": "Neuron device memory",
            "cpu": "host RSS",
        }.get(self.device_kind, f"{device_type} allocator")
        logger.info(
            f"[metrics] MFU peak: {self.peak_source}"
            + (
                f" = {self.peak_flops_per_rank / 1e12:.1f} TFLOP/s per rank"
                if self.peak_flops_per_rank
                else ""
            )
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
        tps = self.ntokens_since_last_log / (seconds * self.parallel_dims.non_data_parallel_size)
        tflops = self.num_flops_per_token * tps / 1e12
        mfu = 100 * tflops * 1e12 / self.peak_flops_per_rank if self.peak_flops_per_rank else None
        memory = self._peak_memory_gib()
        metrics = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": tflops,
            "memory/peak(GiB)": memory,
            "time_metrics/end_to_end(s)": seconds / self.config.log_freq,
            "time_metrics/data_loading(s)": sum(self.data_loading_times)
            / max(1, len(self.data_loading_times)),
        }
        if mfu is not None:
            metrics["mfu(%)"] = mfu
        metrics.update(extra_metrics or {})
        self.logger.log(metrics, step)
        color = self.color
        mfu_text = f"{mfu:.2f}%" if mfu is not None else "n/a"
        memory_text = f"{memory:.2f}GiB" if memory >= 0 else "n/a"
        logger.info(
            f"{color.red}step: {step:2}  {color.green}loss: {global_avg_loss:8.5f}  "
            f"{color.orange}grad_norm: {grad_norm:7.4f}  {color.blue}tps: {round(tps):,}  "
            f"{color.cyan}tflops: {tflops:,.2f}  {color.magenta}mfu: {mfu_text}  "
            f"{color.turquoise}memory: {memory_text} ({self.memory_source}){color.reset}"
        )
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()
