"""Whether a rank's estimated memory fits the memory a rank of the job's device has.

A rank's memory by device kind: a CPU rank shares the host's available memory (``MemAvailable``) with the
node's other ranks; a CUDA rank has its GPU's free memory (queried); a Trainium2 logical NeuronCore at the
default LNC=2 has a quarter of its chip's 96 GiB (trn2.48xlarge: 16 chips, 64 logical cores), before the
Neuron runtime's own share. The estimate (``train.rehearsal``) is a planning figure, so the verdict is
"does not fit" only above the memory, and "near the limit" above 90% of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
TRN2_CORE_BYTES = 24 * GIB  # a trn2 logical NeuronCore at LNC=2: 96 GiB per chip / 4
NEAR_LIMIT = 0.9


@dataclass(frozen=True)
class RankMemory:
    bytes_per_rank: int
    described: str  # where the figure comes from, for the verdict line


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host memory a new allocation can get without swapping (Linux's MemAvailable), else None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def rank_memory(kind: str, ranks_per_node: int) -> RankMemory | None:
    """The memory one rank of this machine has, for a job of ``ranks_per_node`` ranks here; None if unknown."""
    if kind == "cpu":
        available = available_host_bytes()
        if available is None:
            return None
        share = f" / {ranks_per_node} ranks" if ranks_per_node > 1 else ""
        return RankMemory(
            available // max(1, ranks_per_node), f"cpu: {available / GIB:.1f} GiB available{share}"
        )
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return RankMemory(free, f"cuda: {free / GIB:.1f} of {total / GIB:.1f} GiB free on the GPU")
    if kind == "neuron":
        return RankMemory(TRN2_CORE_BYTES, "neuron: 24 GiB per trn2 logical core at LNC=2")
    return None


# Devices a job can be planned for by name (``train --dry-run --memory-per-rank NAME``): one rank's memory.
NAMED_DEVICES: dict[str, RankMemory] = {
    "trn2": RankMemory(TRN2_CORE_BYTES, "trn2: 24 GiB per logical core at LNC=2"),
    "h100": RankMemory(80 * 10**9, "h100: 80 GB (NVIDIA's figure)"),
    "h200": RankMemory(141 * 10**9, "h200: 141 GB (NVIDIA's figure)"),
}


def stated_memory(text: str) -> RankMemory:
    """``--memory-per-rank``: a device named in :data:`NAMED_DEVICES` or a number of GiB; ValueError otherwise."""
    named = NAMED_DEVICES.get(text.strip().lower())
    if named is not None:
        return named
    gib = float(text)  # ValueError for what is not a number
    if not 0 < gib < float("inf"):
        raise ValueError(text)
    return RankMemory(int(gib * GIB), f"--memory-per-rank {gib:g}")


def memory_flag(text: str | None, *, beside: list[str]) -> str | None:
    """``--memory-per-rank TEXT`` checked (a device or GiB), as given; refused beside the launcher's options
    ``beside`` (``print_cmd``, ...), which check nothing against it."""
    from qwen3_titan_common.errors import UserInputError

    if text is None:
        return None
    if beside:
        raise UserInputError(
            f"--memory-per-rank: not with --{beside[0].replace('_', '-')} (it is the memory a dry run or a run "
            "here is checked against)"
        )
    try:
        stated_memory(text)
    except ValueError:
        raise UserInputError(
            f"--memory-per-rank={text}: expected a positive number of GiB or a device ({', '.join(NAMED_DEVICES)})"
        ) from None
    return text


def verdict(needed_bytes: int, memory: RankMemory) -> str:
    """'fits', 'near the limit' or 'does not fit'."""
    if needed_bytes > memory.bytes_per_rank:
        return "does not fit"
    if needed_bytes > NEAR_LIMIT * memory.bytes_per_rank:
        return "near the limit"
    return "fits"


def largest_batch(fixed_bytes: int, activation_bytes: int, batch: int, memory: RankMemory) -> int:
    """The largest per-rank batch whose estimate fits, activations scaling with the batch (0: none fits)."""
    per_row = activation_bytes / max(1, batch)
    room = memory.bytes_per_rank - fixed_bytes
    if room <= 0:
        return 0
    return int(room // per_row) if per_row > 0 else batch
