"""One CPU rank trains its model whole (``models.fsdp_comms``): no FSDP, the bf16 compute by autocast, the
output projection the loss applies in the same dtype; more ranks keep FSDP2."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from qwen3_titan_common.assets import default_architecture
from qwen3_titan_common.compat import apply_lm_head_in_loss
from qwen3_titan_common.models.fsdp_comms import trains_whole
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
from qwen3_titan_common.perf.precision import model_compute_dtype
from qwen3_titan_common.train.loss import TrainedTokenLoss
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    dist_utils.set_spmd_backend("spmd_types")
    dims = ParallelDims.from_config(ParallelismConfig(), 1)
    dims.build_mesh()
    yield dims
    dist.destroy_process_group()


def _parallelized(dims, precision: str):
    spec = titan_qwen3_model_spec(default_architecture(), "debug")
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param=precision),
        parallelism=ParallelismConfig(), compile_config=CompileConfig(), ac_config=None, dump_folder="",
    )  # fmt: skip
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def test_one_cpu_rank_trains_a_dense_model_whole_and_more_ranks_or_experts_shard():
    from qwen3_titan_common.arch.architecture import architecture_from_config
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config
    from qwen3_titan_testing.checkpoints import tiny_qwen3_config

    with torch.device("meta"):
        dense = titan_qwen3_model_config(default_architecture()).build()
        moe = titan_qwen3_model_config(
            architecture_from_config(tiny_qwen3_config(moe=True).to_dict(), where="test")
        ).build()
    assert trains_whole(SimpleNamespace(world_size=1), dense)
    assert not trains_whole(SimpleNamespace(world_size=2), dense)
    assert not trains_whole(SimpleNamespace(world_size=1), moe)


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_the_whole_model_computes_in_the_runs_precision_and_keeps_fp32_weights_and_gradients(
    one_rank, precision
):
    model = _parallelized(one_rank, precision)
    assert not any(isinstance(module, FSDPModule) for module in model.modules())
    compute = torch.bfloat16 if precision == "bfloat16" else torch.float32
    assert model_compute_dtype(model) == (torch.bfloat16 if precision == "bfloat16" else None)
    vocab = default_architecture().vocab_size
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    # The trainer's wiring: the loss applies lm_head in the model's compute dtype.
    loss_fn = TrainedTokenLoss.Config(loss_fn=CrossEntropyLoss.Config()).build()
    loss_fn.set_lm_head(model.lm_head)
    loss_fn.compute_dtype = model_compute_dtype(model)
    logits = model(tokens)
    assert logits.dtype == compute
    apply_lm_head_in_loss(model)
    hidden = model(tokens)
    projected = []
    model.lm_head.register_forward_hook(lambda module, args, out: projected.append(out.dtype))
    loss, _ = loss_fn(hidden, labels, torch.tensor(labels.numel()))
    loss.backward()
    assert projected and set(projected) == {compute}
    # Every parameter is an fp32 tensor with an fp32 gradient, the optimizer's as in a run of fp32.
    for name, param in model.named_parameters():
        assert type(param) is torch.nn.Parameter and param.dtype == torch.float32, name
        assert param.grad is not None and param.grad.dtype == torch.float32, name
    # One step of the loss in bf16 is the fp32 loss to bf16's precision: about ln(vocab) at random weights.
    assert abs(loss.item() - torch.log(torch.tensor(float(vocab))).item()) < 0.5
