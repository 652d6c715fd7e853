"""Checks that the parallel degrees fit the rank count, before anything is launched."""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_titan_common.errors import UserInputError


class LayoutError(UserInputError):
    pass


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int

    def describe(self) -> str:
        return (
            f"{self.world_size} ranks = dp_replicate {self.dp_replicate} x dp_shard(FSDP) {self.dp_shard}"
            f" x context {self.cp} x tensor {self.tp} x pipeline {self.pp}; expert parallel {self.ep}"
        )


def resolve_layout(parallelism, world_size: int) -> Layout:
    """Resolve ``data_parallel_shard_degree=-1`` and check the product, as torchtitan will.

    torchtitan asserts the same thing deep inside Trainer construction; failing here
    gives one line that names every flag involved.
    """
    degrees = {
        "--parallelism.data_parallel_replicate_degree": parallelism.data_parallel_replicate_degree,
        "--parallelism.context_parallel_degree": parallelism.context_parallel_degree,
        "--parallelism.tensor_parallel_degree": parallelism.tensor_parallel_degree,
        "--parallelism.pipeline_parallel_degree": parallelism.pipeline_parallel_degree,
        "--parallelism.expert_parallel_degree": parallelism.expert_parallel_degree,
    }
    for flag, value in degrees.items():
        if value < 1:
            raise LayoutError(f"{flag}={value}: expected an integer >= 1")
    dp_replicate, cp, tp, pp, ep = degrees.values()
    others = dp_replicate * cp * tp * pp
    dp_shard = parallelism.data_parallel_shard_degree
    if dp_shard == -1:
        if world_size % others:
            raise LayoutError(
                f"parallel degrees do not divide the rank count: dp_replicate {dp_replicate} x context {cp}"
                f" x tensor {tp} x pipeline {pp} = {others} does not divide {world_size} ranks"
            )
        dp_shard = world_size // others
    elif dp_shard < 1:
        raise LayoutError(
            f"--parallelism.data_parallel_shard_degree={dp_shard}: expected -1 (infer) or an integer >= 1"
        )
    if dp_replicate * dp_shard * cp * tp * pp != world_size:
        raise LayoutError(
            f"parallel degrees do not multiply to the rank count: dp_replicate {dp_replicate} x dp_shard "
            f"{dp_shard} x context {cp} x tensor {tp} x pipeline {pp} = "
            f"{dp_replicate * dp_shard * cp * tp * pp}, expected {world_size} ranks"
        )
    if ep > 1 and (dp_shard * cp * tp) % ep:
        raise LayoutError(
            f"--parallelism.expert_parallel_degree={ep}: expected a divisor of dp_shard x context x tensor "
            f"= {dp_shard * cp * tp}"
        )
    return Layout(world_size, dp_replicate, dp_shard, cp, tp, pp, ep)
