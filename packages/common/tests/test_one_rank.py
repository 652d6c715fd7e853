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


def _initialised_model():
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config

    model = titan_qwen3_model_config(default_architecture()).build()
    model.init_states()
    return model


def _parallelized(dims, precision: str, arch=None):
    spec = titan_qwen3_model_spec(arch or default_architecture(), "debug")
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
    # In bf16 the loss projects with its own bf16 copy of the weight (train.loss); in fp32 with lm_head itself.
    assert projected == ([] if precision == "bfloat16" else [compute] * loss_fn.num_chunks)
    # Every parameter is an fp32 tensor with an fp32 gradient, the optimizer's as in a run of fp32.
    for name, param in model.named_parameters():
        assert type(param) is torch.nn.Parameter and param.dtype == torch.float32, name
        assert param.grad is not None and param.grad.dtype == torch.float32, name
    # One step of the loss in bf16 is the fp32 loss to bf16's precision: about ln(vocab) at random weights.
    assert abs(loss.item() - torch.log(torch.tensor(float(vocab))).item()) < 0.5


def test_the_losss_bf16_projection_is_autocasts_with_an_fp32_weight_gradient():
    """The bf16 projection of ``train.loss`` against autocast's (the same loss handed lm_head inside a
    container, which it leaves to autocast): the same bf16 products for the logits and the hidden states'
    gradient, so the loss and every gradient but the projection's weight are equal bit for bit. The weight's
    (tied to the embedding) is an fp32 product of the fp32 dlogits and hidden states on our side; autocast's
    rounds both to bf16 (2^-8 each, relative: 8 bits) and each chunk's product to bf16 (2^-8 of its sum of
    |terms|)
    before summing the chunks in fp32: |ours - autocast's| <= 3 x 2^-8 x sum over tokens of |dlogit| |hidden|,
    and fp32's rounding of sums of under 64 terms."""
    import copy

    torch.manual_seed(0)
    ours = _initialised_model()
    reference = copy.deepcopy(ours)
    vocab = default_architecture().vocab_size
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (2, 24), generator=generator)
    labels = torch.randint(0, vocab, (2, 24), generator=generator)
    labels[0, :7] = -100  # a prompt: trained tokens only, 41 of them in 4 chunks (one padded row)
    trained = torch.tensor(int((labels != -100).sum()))
    results = []
    for model, lm_head in ((ours, ours.lm_head), (reference, torch.nn.Sequential(reference.lm_head))):
        loss_fn = TrainedTokenLoss.Config(loss_fn=CrossEntropyLoss.Config()).build()
        loss_fn.set_lm_head(lm_head)
        loss_fn.compute_dtype = model.compute_dtype = torch.bfloat16
        apply_lm_head_in_loss(model)
        for _ in range(2):  # the second call reuses the first's bf16 weight buffer
            model.zero_grad(set_to_none=True)
            loss, _ = loss_fn(model(tokens), labels, trained)
            loss.backward()
        results.append((loss, {name: p.grad for name, p in model.named_parameters()}))
    (loss, grads), (expected_loss, expected) = results
    assert torch.equal(loss, expected_loss)
    tied = {"lm_head.weight", "tok_embeddings.weight"}
    for name in expected.keys() - tied:
        assert torch.equal(grads[name], expected[name]), name
    # sum over the trained tokens of |dlogit| x |hidden|, dlogit = (softmax - onehot) / n.
    with torch.no_grad():
        hidden_ND = reference(tokens)[labels != -100].double()
    weight_VD = reference.lm_head.weight.detach().to(torch.bfloat16).double()
    probs_NV = torch.softmax(hidden_ND.to(torch.bfloat16).double() @ weight_VD.T, dim=-1)
    probs_NV[torch.arange(len(probs_NV)), labels[labels != -100]] -= 1
    token_sums = (probs_NV.abs() / trained).T @ hidden_ND.abs()
    assert tied & expected.keys()
    for name in tied & expected.keys():
        assert grads[name].dtype == torch.float32
        diff = (grads[name].double() - expected[name].double()).abs()
        eps = torch.finfo(torch.float32).eps
        bound = (3 * 2.0**-8 + 64 * eps) * token_sums + 2 * eps * expected[name].double().abs()
        assert (diff <= bound).all(), (name, float((diff - bound).max()))


def test_a_tied_embedding_on_one_rank_takes_its_gradient_as_rows(one_rank):
    """The tied embedding's lookup gives its gradient as rows (``models.fsdp_comms``), added into the dense
    gradient the loss's projection already gave the weight: the weight's gradient is dense and is the dense
    lookup's, up to fp32's rounding of the per-entry sums in another order (a token's rows, then the rest)."""
    import copy
    import dataclasses

    from qwen3_titan_common.train.tolerance import assert_close_reduction

    arch = dataclasses.replace(default_architecture(), tie_word_embeddings=True)
    model = _parallelized(one_rank, "bfloat16", arch)
    assert model.tok_embeddings.sparse and model.tok_embeddings.weight is model.lm_head.weight
    dense = copy.deepcopy(model)
    dense.tok_embeddings.sparse = False
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 16, (2, 32), generator=generator)  # a few ids, each repeated
    labels = torch.randint(0, arch.vocab_size, (2, 32), generator=generator)
    grads, rows_BLD = [], []

    def keep_rows(module, args, out):
        out.register_hook(rows_BLD.append)

    dense.tok_embeddings.register_forward_hook(keep_rows)
    for each in (model, dense):
        loss_fn = TrainedTokenLoss.Config(loss_fn=CrossEntropyLoss.Config()).build()
        loss_fn.set_lm_head(each.lm_head)
        loss_fn.compute_dtype = model_compute_dtype(each)
        apply_lm_head_in_loss(each)
        loss, _ = loss_fn(each(tokens), labels, torch.tensor(labels.numel()))
        loss.backward()
        grads.append(each.tok_embeddings.weight.grad)
    rows, expected = grads
    assert not rows.is_sparse and rows.dtype == torch.float32
    repeats = int(torch.bincount(tokens.flatten()).max())
    assert repeats > 1
    # sum |terms| per entry: the projection's part (|expected| + the rows' sum bounds it) and each row's.
    row_sums = torch.zeros_like(expected).index_add_(0, tokens.flatten(), rows_BLD[0].abs().flatten(0, 1))
    assert_close_reduction(rows, expected, repeats + 1, expected.abs() + 2 * row_sums, name="embedding grad")
