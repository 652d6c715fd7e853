"""The router balance loss of every MoE backend equals transformers' ``load_balancing_loss_func``.

One tiny Qwen3-MoE checkpoint (``save_pretrained``); each backend's model is built as its trainer builds it
with ``--moe.router_aux_loss on`` (routing recorded), loaded with the checkpoint's weights, run in training
mode on the batch transformers' ``Qwen3MoeForCausalLM`` gets with ``output_router_logits=True``. Without
padding transformers counts every token (no attention mask); with a padded row it leaves out the tokens
whose attention mask is 0, and ours leaves out the row's padding document (``counted_tokens``).

Tolerance: both sides are fp32 sums of ``layers * tokens`` probabilities (here 2 * 96; softmaxes over
the experts), then a sum over the experts, all of positive terms: the derived bound of that chain
(``qwen3_titan_common.train.tolerance``, with sum |terms| = the loss), about 5e-5 of a loss near 2.
"""

import pytest
import torch
from qwen3_titan_common.components.router_balance import counted_tokens
from qwen3_titan_common.hf.model_dir import open_model_dir
from qwen3_titan_common.models.routing import router_balance_loss, take_routing
from qwen3_titan_common.scripts.eval import eval_model_builder
from qwen3_titan_common.train.tolerance import assert_close_reduction, qwen3_forward_lengths, reduction_atol
from qwen3_titan_testing.checkpoints import make_tiny_checkpoint
from torchtitan.components.loss import IGNORE_INDEX

ROWS, SEQ, PAD = 2, 48, 13


class GateTerms:
    """sum |terms| of each router weight's gradient, from the gate's inputs and its logits' gradients.

    A gate's weight gradient is a sum over tokens of (d loss / d logit) x input, so its entries' sum |terms|
    is |d loss / d logits|^T @ |inputs|: forward hooks keep each gate's input and retain its logits' grad.
    """

    def __init__(self, model: torch.nn.Module, gate_names: list[str]):
        self._seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks = [
            model.get_submodule(name).register_forward_hook(self._keep(name)) for name in gate_names
        ]

    def _keep(self, name: str):
        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            logits.retain_grad()
            self._seen[name] = (args[0].detach(), logits)

        return hook

    def abs_sums(self) -> dict[str, torch.Tensor]:
        """Per gate (after the backward): sum |terms| of each entry of its weight gradient (experts x hidden)."""
        for hook in self._hooks:
            hook.remove()
        sums = {}
        for name, (inputs, logits) in self._seen.items():
            grad = logits.grad.reshape(-1, logits.shape[-1])
            sums[name] = grad.abs().T @ inputs.reshape(-1, inputs.shape[-1]).abs()
        return sums


def _builder(backend: str):
    """The model ``eval --backend`` builds (torchtitan's Qwen3 for native): the one each trainer trains."""
    return eval_model_builder(None if backend == "native" else f"{backend}-backend")[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "tiny-moe", moe=True, seed=3)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    return path, reference


def _batch(padded: bool):
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 4096, (ROWS, SEQ), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(SEQ).repeat(ROWS, 1)
    attention_mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    if padded:
        # Row 1 ends in padding, as the dataloader pads: EOS inputs, ignored labels, one document of its own.
        tokens[1, -PAD:] = 0
        labels[1, -PAD - 1 :] = IGNORE_INDEX
        labels[1, -PAD - 1] = 0  # the document's last label is its EOS
        positions[1, -PAD:] = torch.arange(PAD)
        attention_mask[1, -PAD:] = 0
    return tokens, labels, positions, attention_mask


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("backend", ["native", "hf-v5", "nki-moe"])
def test_balance_loss_equals_transformers(checkpoint, backend, padded):
    path, reference = checkpoint
    reference.zero_grad(set_to_none=True)
    weights = open_model_dir(path)
    layers = range(weights.architecture.num_hidden_layers)
    reference_terms = GateTerms(reference, [f"model.layers.{layer}.mlp.gate" for layer in layers])
    tokens, labels, positions, attention_mask = _batch(padded)
    model = _builder(backend)(
        weights.architecture, weights, dtype=torch.float32, seq_len=SEQ, routing_recorded=True
    ).train()
    model(tokens, positions)
    records = take_routing([model])
    assert len(records) == weights.architecture.num_hidden_layers
    ours = router_balance_loss(records, counted_tokens(labels, positions))

    theirs = reference(
        input_ids=tokens,
        attention_mask=attention_mask if padded else None,
        output_router_logits=True,
        use_cache=False,
    ).aux_loss
    arch = weights.architecture
    chain = (arch.num_hidden_layers * ROWS * SEQ, arch.moe.num_experts, arch.moe.num_experts, 4)
    assert_close_reduction(ours.detach(), theirs.detach(), chain, abs(float(theirs)), name="balance loss")
    # The check can fail: counting the padding too gives another loss.
    if padded:
        assert abs(float(router_balance_loss(records)) - float(theirs)) > 1e-4
    # The records were handed out once.
    assert take_routing([model]) == []
    # The gradient reaches the routers as transformers' does.
    ours.backward()
    theirs.backward()
    abs_sums = reference_terms.abs_sums()
    for layer in layers:
        ref_grad = reference.get_parameter(f"model.layers.{layer}.mlp.gate.weight").grad
        name = (
            f"model.layers.{layer}.mlp.gate.weight"
            if backend == "hf-v5"
            else f"layers.{layer}.moe.router.gate.weight"
        )
        # A sum over the 96 tokens of logit gradients that carry the loss's chain: both chained.
        assert_close_reduction(
            model.get_parameter(name).grad, ref_grad, (ROWS * SEQ, *chain),
            abs_sums[f"model.layers.{layer}.mlp.gate"], name=name,
        )  # fmt: skip


def test_counted_tokens_leave_out_only_padding():
    tokens, labels, positions, attention_mask = _batch(padded=True)
    # A prompt (ignored labels) followed by an answer is one document: all of it counts.
    labels[0, :10] = IGNORE_INDEX
    counted = counted_tokens(labels, positions)
    assert torch.equal(counted, attention_mask.bool())


def _two_rank_worker(rank: int, port: int, path: str, scope: str, out: str) -> None:
    import json
    import os

    import torch.distributed as dist
    from safetensors.torch import save_file

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        term, grads, _ = _balance_step(
            path, scope, rows=slice(2 * rank, 2 * rank + 2), group=dist.group.WORLD
        )
        for grad in grads.values():
            dist.all_reduce(grad)  # torchtitan sums gradients over data-parallel ranks
        if rank == 0:
            save_file(grads, f"{out}/grads.safetensors")
            with open(f"{out}/term.json", "w") as f:
                json.dump(term, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _balance_step(path, scope: str, rows: slice, group=None):
    """One training forward and backward of the loss with the balance term on ``rows`` of a 4-row batch."""
    from qwen3_titan_common.components.router_balance import LMLossWithRouterBalance
    from qwen3_titan_common.hf.eval_models import eval_model, native_qwen3

    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, 4096, (4, SEQ), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(SEQ).repeat(4, 1)
    weights = open_model_dir(path)
    model = eval_model(
        native_qwen3, weights.architecture, weights, dtype=torch.float32, seq_len=SEQ, routing_recorded=True
    )
    model.train()
    gates = [f"layers.{layer}.moe.router.gate" for layer in range(weights.architecture.num_hidden_layers)]
    terms = GateTerms(model, gates)
    loss_fn = LMLossWithRouterBalance.Config(coefficient=0.01, scope=scope).build()
    loss_fn.bind([model], group=group, microbatches=1)
    loss_fn.start_step()
    logits = model(tokens[rows], positions[rows])
    global_tokens = torch.tensor(labels.numel())
    loss, _ = loss_fn(logits, labels[rows], global_tokens, positions=positions[rows])
    loss.backward()
    grads = {
        name: param.grad.detach().clone() for name, param in model.named_parameters() if "router" in name
    }
    abs_sums = {f"{gate}.weight": value for gate, value in terms.abs_sums().items()}
    return loss_fn.step_term(), grads, abs_sums


@pytest.mark.parametrize("scope", ["global_batch", "micro_batch"])
def test_global_batch_scope_on_two_ranks_equals_one_rank_on_the_whole_batch(checkpoint, tmp_path, scope):
    import json
    import socket

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    path, _ = checkpoint
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_rank_worker, args=(port, str(path), scope, str(tmp_path)), nprocs=2, join=True)
    two_term = json.loads((tmp_path / "term.json").read_text())
    two_grads = load_file(tmp_path / "grads.safetensors")
    one_term, one_grads, abs_sums = _balance_step(path, "micro_batch", rows=slice(0, 4))
    if scope == "global_batch":
        # Sums of 2 layers x 192 tokens on each side (positive terms), then one over the experts: the
        # derived bound of that chain, relative to the term.
        arch = open_model_dir(path).architecture
        chain = (arch.num_hidden_layers * 4 * SEQ, arch.moe.num_experts, arch.moe.num_experts, 4)
        assert abs(two_term - one_term) <= reduction_atol(chain, one_term), (two_term, one_term)
        # A router's gradient: a sum over the 192 tokens of logit gradients that carry the language-model
        # loss's backward (a forward's chain again) on top of its forward and the balance term's chain.
        backward = 2 * qwen3_forward_lengths(arch, SEQ)
        for name, grad in one_grads.items():
            assert_close_reduction(
                two_grads[name], grad, (4 * SEQ, *backward, *chain), abs_sums[name], name=name
            )
    else:
        # transformers' own scope balances each rank's micro-batch: another loss (the comparison can fail).
        assert abs(two_term - one_term) > 1e-4 * one_term, (two_term, one_term)
