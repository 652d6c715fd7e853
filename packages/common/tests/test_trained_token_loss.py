"""The CPU's loss (``components.loss``): torchtitan's chunked loss over the trained tokens only gives the plain
cross-entropy's loss and gradients; it applies where the hidden states are whole, and nowhere else."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from qwen3_titan_common.assets import default_architecture
from qwen3_titan_common.compat import apply_lm_head_in_loss
from qwen3_titan_common.components.loss import (
    TrainedTokenLoss,
    loss_chunks,
    loss_on_trained_tokens,
    trained_token_loss_applies,
)
from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config
from qwen3_titan_common.train.tolerance import assert_close_reduction, reduction_atol
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss


def _model():
    torch.manual_seed(0)
    model = titan_qwen3_model_config(default_architecture(), attention="blocks").build()
    model.init_states()
    return model.to(torch.float64)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("num_chunks", [1, 3, 8])
def test_the_trained_tokens_loss_and_gradients_equal_the_plain_cross_entropy(num_chunks):
    arch = default_architecture()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, arch.vocab_size, (2, 48), generator=generator)
    labels = torch.randint(0, arch.vocab_size, (2, 48), generator=generator)
    labels[0, :20] = IGNORE_INDEX  # a prompt
    labels[1, 30:] = IGNORE_INDEX  # padding
    labels[1, 5:9] = IGNORE_INDEX
    positions = torch.cat([torch.arange(24), torch.arange(24)]).repeat(2, 1)
    trained = (labels != IGNORE_INDEX).sum()

    ours = _model()
    loss_fn = TrainedTokenLoss.Config(num_chunks=num_chunks, loss_fn=CrossEntropyLoss.Config()).build()
    loss_fn.set_lm_head(ours.lm_head)
    apply_lm_head_in_loss(ours)
    hidden = ours(tokens, positions)
    assert hidden.shape[-1] == arch.hidden_size  # the model returned its hidden states
    hidden.retain_grad()
    chunked, _ = loss_fn(hidden, labels, trained)
    chunked.backward()

    # The plain loss on every position's logits, with the hidden states cut from the model: its own gradient of
    # the hidden states, and lm_head's gradient from the logits.
    plain = _model()
    apply_lm_head_in_loss(plain)
    plain_hidden = plain(tokens, positions)
    cut = plain_hidden.detach().requires_grad_()
    logits = plain.lm_head(cut)
    logits.retain_grad()
    loss, _ = CrossEntropyLoss.Config().build()(logits, labels, trained)
    loss.backward()

    # The trained tokens' cross-entropies (torchtitan computes them in fp32, each a log-sum-exp over the
    # vocabulary) summed in another order (chunk by chunk): a mean of positive terms, so sum |terms| is the loss.
    n = int(trained)
    assert_close_reduction(chunked, loss, [arch.vocab_size, n], loss.item(), name="loss")
    # torchtitan's chunked loss accumulates the hidden states' gradient in fp32 (GradAccumulator): one fp32
    # rounding of each element, on top of fp64 sums over the vocabulary of |dlogit| x |weight|.
    weight = plain.lm_head.weight.detach()
    vocab_sums = logits.grad.abs().flatten(0, 1) @ weight.abs()
    assert_close_reduction(
        hidden.grad, cut.grad, 1, cut.grad.abs(),
        atol=reduction_atol(arch.vocab_size, vocab_sums, torch.float64).view_as(cut.grad), name="hidden grad",
    )  # fmt: skip
    # The decoder's gradients from the hidden states' gradient the chunked loss passed down: the plain model's
    # backward of the same gradient computes the same thing, bit for bit; the output projection's own gradient
    # (tied to the embedding) sums the trained tokens' dlogit x hidden in chunks instead of at once.
    plain_hidden.backward(hidden.grad)
    expected, got = _grads(plain), _grads(ours)
    assert expected.keys() == got.keys()
    tied = {"lm_head.weight", "tok_embeddings.weight"}
    for name in expected.keys() - tied:
        assert torch.equal(got[name], expected[name]), name
    # The weight's gradient: the tokens' dlogit x hidden (chunked on one side) plus the embedding's part (from
    # the same decoder backward, the same bits on both sides) in one last addition, rounded to the result.
    token_sums = logits.grad.abs().flatten(0, 1).T @ cut.detach().abs().flatten(0, 1)
    for name in expected.keys() & tied:
        assert_close_reduction(
            got[name],
            expected[name],
            n + 1,
            token_sums + expected[name].abs(),
            dtype=torch.float64,
            name=name,
        )


def test_a_batch_without_trained_tokens_has_zero_loss_and_gradient():
    model = _model()
    loss_fn = TrainedTokenLoss.Config(loss_fn=CrossEntropyLoss.Config()).build()
    loss_fn.set_lm_head(model.lm_head)
    apply_lm_head_in_loss(model)
    labels = torch.full((1, 16), IGNORE_INDEX)
    loss, _ = loss_fn(model(torch.zeros(1, 16, dtype=torch.long)), labels, torch.tensor(1))
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_it_applies_on_the_cpu_with_whole_hidden_states_and_leaves_other_losses():
    from torchtitan.config import ParallelismConfig

    plain, one = CrossEntropyLoss.Config(global_vocab_size=4096), ParallelismConfig()

    def resolved(loss, device_type="cpu", **degrees):
        parallelism = dataclasses.replace(one, **degrees)
        return loss_on_trained_tokens(loss, parallelism=parallelism, seq_len=2048, device_type=device_type)

    assert trained_token_loss_applies(one, "cpu")
    wrapped = resolved(plain)
    assert isinstance(wrapped, TrainedTokenLoss.Config) and wrapped.loss_fn is plain
    assert resolved(wrapped) is wrapped  # not wrapped twice
    # Context parallelism gives each rank whole tokens of its own: the trained ones are selected there too.
    assert isinstance(resolved(plain, context_parallel_degree=2), TrainedTokenLoss.Config)
    # Hidden states split along the vocabulary or in stages, or another device: torchtitan's chunked loss along
    # the rows, in chunks that split a rank's rows equally (2048 tokens: 8; under CP 2 too).
    for field in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        assert not trained_token_loss_applies(dataclasses.replace(one, **{field: 2}), "cpu")
        chunked = resolved(plain, **{field: 2})
        assert type(chunked) is ChunkedLossWrapper.Config and chunked.loss_fn is plain, field
        assert chunked.num_chunks == 8
    assert not trained_token_loss_applies(one, "cuda")
    chunked = resolved(plain, "cuda", context_parallel_degree=2)
    assert type(chunked) is ChunkedLossWrapper.Config and chunked.loss_fn is plain
    assert chunked.num_chunks == 8  # a CP rank's 1024 tokens
    assert [loss_chunks(n) for n in (2048, 100, 7, 1)] == [8, 5, 7, 1]
