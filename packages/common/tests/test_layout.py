import pytest
from qwen3_titan_common.models.layout import LayoutError, resolve_layout
from torchtitan.config import ParallelismConfig


def test_fsdp_degree_is_inferred_from_the_rank_count():
    layout = resolve_layout(ParallelismConfig(tensor_parallel_degree=4), 256)
    assert (layout.dp_shard, layout.tp) == (64, 4)


def test_explicit_degrees_must_multiply_to_the_rank_count():
    cfg = ParallelismConfig(data_parallel_shard_degree=8, tensor_parallel_degree=4)
    with pytest.raises(
        LayoutError, match=r"dp_shard 8 x context 1 x tensor 4 x pipeline 1 = 32, expected 64 ranks"
    ):
        resolve_layout(cfg, 64)


def test_degrees_that_do_not_divide_are_named():
    with pytest.raises(LayoutError, match="tensor 3 .* does not divide 64 ranks"):
        resolve_layout(ParallelismConfig(tensor_parallel_degree=3), 64)


def test_expert_parallel_must_divide_the_sharded_ranks():
    with pytest.raises(LayoutError, match="--parallelism.expert_parallel_degree=3"):
        resolve_layout(ParallelismConfig(expert_parallel_degree=3), 64)


def test_zero_degree_names_the_flag():
    with pytest.raises(LayoutError, match="--parallelism.pipeline_parallel_degree=0"):
        resolve_layout(ParallelismConfig(pipeline_parallel_degree=0), 8)
