"""The experts' load the step line shows (``perf.expert_load``): every layer's, whichever rank holds it.

Under pipeline parallelism each stage holds its own layers, and the step line is printed by rank 0, the first
stage: its counts alone would leave out every later stage's layers (their collapse unseen, their drops
uncounted). Two gloo ranks, torchtitan's own mesh (``ParallelDims``), against the counts one process holds.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from qwen3_titan_common.perf.expert_load import ExpertCounts, all_ranks_counts, dropped_assignments

E, K = 8, 2


def _counts(layer: int) -> torch.Tensor:
    """Layer ``layer``'s tokens per expert on data-parallel rank 0 (float, as torchtitan's counter is)."""
    return torch.arange(E, dtype=torch.float32) * (layer + 1) + layer


class _Dispatcher:
    def __init__(self, dropped: int, routed: int):
        self.counts = (dropped, routed)

    def take_dropped(self) -> tuple[int, int]:
        return self.counts


class _Stage(torch.nn.Module):
    """A pipeline stage's model part: its layers' counts, named by their index in the model (as both backends'
    decoders name them), and one fixed-capacity dispatcher per layer."""

    def __init__(self, layers: list[int]):
        super().__init__()
        self.layers = layers
        self.dispatchers = torch.nn.ModuleList()
        for layer in layers:
            holder = torch.nn.Module()
            holder.token_dispatcher = _Dispatcher(dropped=layer, routed=100)
            self.dispatchers.append(holder)

    def take_expert_counts(self) -> ExpertCounts | None:
        if not self.layers:
            return None
        return ExpertCounts(K, {str(layer): _counts(layer) for layer in self.layers})


# Per case, the layers each of the two stages holds.
CASES = {"two-layers-each": [[0, 1], [2, 3]], "the-last-stage-holds-none": [[0, 1, 2], []], "dense": [[], []]}


def _rank(rank: int, store_path: str, results) -> None:
    # FSDP's import registers torch's "fake" process group, which torchtitan's mesh gives its dimensions of
    # degree 1 (a rank imports it with torchtitan's trainer).
    import torch.distributed.fsdp  # noqa: F401
    from torchtitan.distributed.parallel_dims import ParallelDims

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2)
        dims.build_mesh()
        for case, stages in CASES.items():
            counts = all_ranks_counts([_Stage(stages[rank])], dims)
            shown = (
                None
                if counts is None
                else (counts.top_k, {k: v.tolist() for k, v in counts.by_layer.items()})
            )
            results[case, rank] = (shown, dropped_assignments([_Stage(stages[rank])], dims))
    finally:
        dist.destroy_process_group()


def test_every_stage_sees_every_layer_of_the_pipeline(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(str(tmp_path / "store"), results), nprocs=2, start_method="spawn")
        results = dict(results)
    for case, stages in CASES.items():
        layers = sorted(layer for stage in stages for layer in stage)
        for rank in range(2):
            shown, dropped = results[case, rank]
            if not layers:
                assert shown is None and dropped == (0, 0), case
                continue
            expected = {str(layer): _counts(layer).tolist() for layer in layers}
            assert shown == (K, expected), (case, rank)  # integer counts: exact
            # Each stage's drops of its own layers, summed over the pipeline.
            assert dropped == (sum(layers), 100 * len(layers)), (case, rank)
