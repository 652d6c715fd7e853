"""One CPU rank trains its model whole (``models.fsdp_comms``): no FSDP, the bf16 compute by autocast, the
output projection the loss applies in the same dtype; more ranks keep FSDP2."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from qwen3_titan_common.assets import default_architecture
from qwen3_titan_common.compat import apply_lm_head_in_loss
from qwen3_titan_common.components.loss import TrainedTokenLoss
from qwen3_titan_common.models.fsdp_comms import trains_whole
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_spec
from qwen3_titan_common.perf.precision import model_compute_dtype
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
    # In bf16 the loss projects with its own bf16 copy of the weight (components.loss); in fp32 with lm_head itself.
    assert projected == ([] if precision == "bfloat16" else [compute] * loss_fn.num_chunks)
    # Every parameter is an fp32 tensor with an fp32 gradient, the optimizer's as in a run of fp32.
    for name, param in model.named_parameters():
        assert type(param) is torch.nn.Parameter and param.dtype == torch.float32, name
        assert param.grad is not None and param.grad.dtype == torch.float32, name
    # One step of the loss in bf16 is the fp32 loss to bf16's precision: about ln(vocab) at random weights.
    assert abs(loss.item() - torch.log(torch.tensor(float(vocab))).item()) < 0.5


def _exact_and_bounds(hidden_ND, labels_N, weight_VD, divisor):
    """The exact loss and gradients (fp64) of the bf16 product of ``hidden`` and ``weight`` that
    ``perf.projection`` computes, and bounds on its deviations by the tolerance rule (``train.tolerance``):
    its logits are bf16 roundings (u = 2^-8) of D-term fp32 sums; the loss moves by at most twice a row's
    largest logit error (log-sum-exp and the picked logit are 1-Lipschitz in it), the softmax by the factor
    exp(2 x that) - 1 relative, plus fp32's V-term sum and a few elementwise roundings (the subtraction of the
    row's maximum: eps of the row's range); the hidden states' gradient is a bf16 product of the gradient
    rounded to bf16; the weight's an fp32 sum over the rows with the fp32 hidden states."""
    from qwen3_titan_common.train.tolerance import reduction_atol

    eps, u16 = torch.finfo(torch.float32).eps, 2.0**-8
    rows, dim = hidden_ND.shape
    vocab = weight_VD.shape[0]
    h16, w16, h32 = hidden_ND.bfloat16().double(), weight_VD.bfloat16().double(), hidden_ND.double()
    logits = h16 @ w16.T
    sums = h16.abs() @ w16.abs().T
    logit_err = reduction_atol(dim, sums) + u16 * (logits.abs() + reduction_atol(dim, sums))
    trained = labels_N != -100
    share = trained.double()[:, None] / float(divisor)
    span = (logits.amax(-1) - logits.amin(-1))[:, None]
    fp32_rel = reduction_atol(vocab, 1.0) + 6 * eps * (1 + span)
    shift = 2 * logit_err.amax(-1, keepdim=True)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    picked = logits.gather(1, labels_N.clamp(min=0)[:, None])
    row_loss = torch.where(trained[:, None], lse - picked, 0.0)
    loss_err = (
        (shift + fp32_rel + 2 * eps * (lse.abs() + row_loss.abs())) * trained[:, None]
    ).sum() / divisor
    loss_err = loss_err + reduction_atol(rows, row_loss.abs().sum() / divisor)
    probs = torch.softmax(logits, -1)
    onehot = torch.zeros_like(probs).scatter_(1, labels_N.clamp(min=0)[:, None], 1.0)
    dlogits = (probs - onehot) * share
    err32 = share * (probs * (torch.expm1(shift) + fp32_rel) + eps * onehot)
    err16 = err32 + u16 * (dlogits.abs() + err32)
    hidden_grad = dlogits @ w16
    hidden_sums = (dlogits.abs() + err16) @ w16.abs()
    hidden_err = (
        err16 @ w16.abs() + reduction_atol(vocab, hidden_sums) + u16 * (hidden_grad.abs() + hidden_sums)
    )
    weight_grad = dlogits.T @ h32
    weight_err = err32.T @ h32.abs() + reduction_atol(rows, (dlogits.abs() + err32).T @ h32.abs())
    return (row_loss.sum() / divisor, loss_err), (hidden_grad, hidden_err), (weight_grad, weight_err)


def test_the_fused_projection_and_cross_entropy_are_the_exact_ones_of_its_bf16_product():
    """``perf.projection`` against fp64 over the same bf16-rounded operands: the loss, the hidden states'
    gradient and the weight's (summed into ``weight.grad`` across calls, into a buffer it keeps), with ignored
    rows, an uneven last chunk, a second call of fewer rows in the same buffers, and validation's call."""
    from qwen3_titan_common.perf.projection import ProjectionCrossEntropy

    generator = torch.Generator().manual_seed(4)
    vocab, dim = 512, 48
    lm_head = torch.nn.Linear(dim, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, dim, generator=generator) * 0.3)
    batches = []
    for rows in (37, 21):
        hidden_ND = torch.randn(rows, dim, generator=generator).requires_grad_()
        labels_N = torch.randint(0, vocab, (rows,), generator=generator)
        labels_N[::5] = -100
        batches.append((hidden_ND, labels_N, torch.tensor(int((labels_N != -100).sum()) + 3)))
    projection, buffers = None, None
    weight_grad, weight_err = 0.0, 0.0
    for hidden_ND, labels_N, divisor in batches:
        projection = ProjectionCrossEntropy.of(lm_head, torch.bfloat16, kept=projection)
        loss, grad_ND = projection(hidden_ND, labels_N, chunk_rows=8, divisor=divisor)
        buffers = buffers or (projection._probs_CV, projection._logits_CV)
        assert (projection._probs_CV, projection._logits_CV) == buffers  # kept, not re-allocated
        (exact_loss, loss_err), (hidden_grad, hidden_err), (weight_part, weight_part_err) = _exact_and_bounds(
            hidden_ND.detach(), labels_N, lm_head.weight.detach(), divisor
        )
        assert abs(loss.item() - exact_loss.item()) <= loss_err.item()
        assert ((grad_ND.double() - hidden_grad).abs() <= hidden_err).all()
        assert not grad_ND[labels_N == -100].any()
        weight_grad, weight_err = weight_grad + weight_part, weight_err + weight_part_err
        assert ((lm_head.weight.grad.double() - weight_grad).abs() <= weight_err).all()
    kept = lm_head.weight.grad
    lm_head.weight.grad = None  # the optimizer's zero_grad: the next call writes the same buffer over
    hidden_ND, labels_N, divisor = batches[1]
    projection = ProjectionCrossEntropy.of(lm_head, torch.bfloat16, kept=projection)
    projection(hidden_ND, labels_N, chunk_rows=8, divisor=divisor)
    assert lm_head.weight.grad is kept
    assert ((kept.double() - weight_part).abs() <= weight_part_err).all()
    # Validation: the loss only, no gradient anywhere.
    loss, grad_ND = projection(hidden_ND.detach(), labels_N, chunk_rows=8, divisor=divisor)
    assert grad_ND is None and lm_head.weight.grad is kept
    assert abs(loss.item() - exact_loss.item()) <= loss_err.item()


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
