"""Context parallelism over per-document attention (``models.context_parallel``), in real gloo process groups.

A row's tokens are dealt to 2 and 4 CP ranks (zig-zag chunks), with documents that cross the chunk edges, rows
that end in padding and a row of one document. Each rank's attention output and the gradients of its queries,
keys and values equal the dense SDPA reference under the document mask at its tokens, within the derived
bound, on every path (the CPU's fused kernel, plain ops, Neuron's fixed shapes). A whole model's per-token
losses at CP 2 and 4 equal CP 1's, and a token changed in one document changes that document's losses only.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from qwen3_titan_common.models.context_parallel import (
    ContextParallelBlocks,
    block_size_for,
    context_parallel_blocks,
    local_token_index,
)
from qwen3_titan_common.models.document_blocks import document_blocks
from qwen3_titan_testing.attention_cases import (
    assert_close,
    attention_bounds,
    dense_attention,
    inputs,
    rows,
)

SEQ_LEN = 192  # 2 x 4 chunks of 24 tokens at CP 4, of 48 at CP 2
BLOCK = 16
PATHS = ("CPU fused kernel", "plain ops", "fixed shapes")


def _positions(seed: int) -> torch.Tensor:
    """Two packed rows (documents of 1-70 tokens, a document across chunk edges, padding) and one document."""
    return torch.cat([rows(seed, batch=2, seq_len=SEQ_LEN), torch.arange(SEQ_LEN)[None]])


def _in_process_group(rank: int, degree: int, store: str, work, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", store=dist.FileStore(store, degree), rank=rank, world_size=degree)
    try:
        results[rank] = work(rank, degree)
    finally:
        dist.destroy_process_group()


def _run(work, degree: int, tmp_path) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _in_process_group,
            args=(degree, str(tmp_path / f"store-{degree}"), work, results),
            nprocs=degree,
            start_method="spawn",
        )
        return dict(results)


def _everything_on_rank(rank: int, degree: int) -> dict:
    return {"attention": _attention_on_rank(rank, degree), "losses": _losses_on_rank(rank, degree)}


@pytest.fixture(scope="module")
def on_ranks(tmp_path_factory):
    """What each rank of a CP group of ``degree`` computes (the attention, then the model's losses): one group
    of processes per degree for every test that reads it (each process starts torch afresh)."""

    @functools.cache
    def found(degree: int) -> dict:
        return _run(_everything_on_rank, degree, tmp_path_factory.mktemp(f"cp-{degree}"))

    def run(degree: int, part: str) -> dict:
        return {rank: results[part] for rank, results in found(degree).items()}

    return run


def _blocks(positions: torch.Tensor, degree: int, rank: int, path: str) -> ContextParallelBlocks:
    cp = context_parallel_blocks(
        positions, group=dist.group.WORLD, degree=degree, rank=rank, block_size=BLOCK, pairs_per_chunk=7,
        fixed_shapes=path == "fixed shapes",
    )  # fmt: skip
    if path == "plain ops":  # what a device without the CPU's fused kernel runs
        cp = dataclasses.replace(cp, blocks=dataclasses.replace(cp.blocks, spans=()))
    return cp


def _attention_on_rank(rank: int, degree: int) -> dict:
    from qwen3_titan_common.models.attention import DocumentBlockAttention

    attention = DocumentBlockAttention.Config().build()
    index = local_token_index(SEQ_LEN, degree, rank)
    found = {}
    for seed in range(2):
        positions = _positions(seed)
        q, k, v = (
            t.detach()[:, index].clone().requires_grad_() for t in inputs(seed, positions, torch.float64)
        )
        grad_out = torch.randn(q.shape[:2] + (q.shape[2], q.shape[3]), dtype=torch.float64,
                               generator=torch.Generator().manual_seed(100 + seed))  # fmt: skip
        for path in PATHS:
            out = attention(q, k, v, attention_masks=_blocks(positions, degree, rank, path))
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            found[(seed, path)] = (out.detach(), *grads, grad_out)
    return found


@pytest.mark.parametrize("degree", [2, 4])
def test_each_rank_computes_the_dense_document_attention_of_its_tokens(on_ranks, degree):
    found = on_ranks(degree, "attention")
    for seed in range(2):
        positions = _positions(seed)
        q, k, v = inputs(seed, positions, torch.float64)
        # The whole row's gradient is each rank's grad_out at its tokens.
        grad_out = torch.zeros(q.shape, dtype=torch.float64)
        for rank in range(degree):
            grad_out[:, local_token_index(SEQ_LEN, degree, rank)] = found[rank][(seed, PATHS[0])][4]
        dense = dense_attention(q, k, v, positions)
        dense_grads = torch.autograd.grad(dense, (q, k, v), grad_out)
        bounds = attention_bounds(q, k, v, grad_out, torch.float64)
        for rank in range(degree):
            index = local_token_index(SEQ_LEN, degree, rank)
            for path in PATHS:
                out, gq, gk, gv, _ = found[rank][(seed, path)]
                where = f"CP {degree} rank {rank} seed {seed} {path}"
                assert_close(out, dense[:, index].detach(), bounds["out"], torch.float64, f"out, {where}")
                for name, ours, reference in zip("qkv", (gq, gk, gv), dense_grads, strict=True):
                    assert_close(
                        ours, reference[:, index], bounds[name], torch.float64, f"grad {name}, {where}"
                    )


def test_the_zigzag_split_covers_the_row_once_and_balances_the_block_pairs():
    for degree in (1, 2, 4, 8):
        held = torch.cat([local_token_index(SEQ_LEN * 2, degree, rank) for rank in range(degree)])
        assert sorted(held.tolist()) == list(range(SEQ_LEN * 2))
    # One long document (causal work): every rank computes the same number of block pairs.
    positions = torch.arange(1024)[None]
    for degree in (2, 4):
        pairs = {
            context_parallel_blocks(
                positions, group=None, degree=degree, rank=rank, block_size=64, pairs_per_chunk=32,
                fixed_shapes=False,
            ).blocks.num_pairs
            for rank in range(degree)
        }  # fmt: skip
        assert len(pairs) == 1
    # A block never straddles two ranks' chunks; a row that does not split is refused.
    assert block_size_for(192, 4, 64) == 8 and block_size_for(4096, 4, 64) == 64
    with pytest.raises(ValueError, match="does not split into 2 x 4 equal chunks"):
        local_token_index(100, 4, 0)
    with pytest.raises(ValueError, match="outside a row"):
        document_blocks(positions, block_size=64, query_blocks=torch.tensor([16]))


# -- a whole model: the same per-token losses at CP 1, 2, 4, and no leak between documents --------------------

DOCUMENTS = (30, 100, 40, 22)  # row 0: document 1 spans tokens 30-129, across chunk edges at CP 2 and 4
CHANGED = 60  # a token of document 1


def _model_inputs(changed: bool):
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 4096, (2, SEQ_LEN + 1), generator=generator)
    if changed:
        tokens[0, CHANGED] = (tokens[0, CHANGED] + 1) % 4096
    first = torch.cat([torch.arange(n) for n in DOCUMENTS])
    positions = torch.stack([first, rows(5, batch=1, seq_len=SEQ_LEN)[0]])
    return tokens[:, :-1], tokens[:, 1:], positions


def _model():
    from qwen3_titan_common.arch.architecture import architecture_from_config
    from qwen3_titan_common.models.attention import DocumentBlockAttention
    from qwen3_titan_common.models.qwen3 import titan_qwen3_model_config
    from qwen3_titan_testing.checkpoints import tiny_qwen3_config

    torch.manual_seed(0)
    arch = architecture_from_config(tiny_qwen3_config(layers=2).to_dict())
    config = titan_qwen3_model_config(arch, attention="blocks")
    assert isinstance(config.first_attention.inner_attention, DocumentBlockAttention.Config)
    model = config.build()
    model.init_states()
    return arch, model.eval()


def _token_losses(model, tokens, labels, positions, masks=None) -> torch.Tensor:
    with torch.no_grad():
        logits = model(tokens, positions, masks)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(
        labels.shape
    )


def _losses_on_rank(rank: int, degree: int) -> dict:
    _, model = _model()
    index = local_token_index(SEQ_LEN, degree, rank)
    found = {}
    for changed in (False, True):
        tokens, labels, positions = _model_inputs(changed)
        masks = _blocks(positions, degree, rank, "CPU fused kernel")
        found[changed] = _token_losses(model, tokens[:, index], labels[:, index], positions[:, index], masks)
    return found


@pytest.mark.parametrize("degree", [2, 4])
def test_a_models_token_losses_equal_one_ranks_and_no_document_leaks(on_ranks, degree):
    from qwen3_titan_common.train.tolerance import ModelBounds

    arch, model = _model()
    one_rank = {changed: _token_losses(model, *_model_inputs(changed)) for changed in (False, True)}
    found = on_ranks(degree, "losses")
    bounds = ModelBounds.from_state_dict(
        arch,
        {
            "model.norm.weight": model.norm.weight,
            "lm_head.weight": model.lm_head.weight,
            "model.embed_tokens.weight": model.tok_embeddings.weight,
        },
    )
    wholes = {}
    for changed in (False, True):
        whole = torch.zeros_like(one_rank[changed])
        for rank in range(degree):
            whole[:, local_token_index(SEQ_LEN, degree, rank)] = found[rank][changed]
        reference = one_rank[changed]
        bound = torch.tensor(
            [bounds.loss_atol(float(x), tokens=1, seq_len=SEQ_LEN) for x in reference.flatten()]
        ).view(reference.shape)
        assert ((whole - reference).abs() <= bound).all(), (whole - reference).abs().max()
        wholes[changed] = whole
    # The leak probe, at this CP degree and at one rank: only document 1's tokens (from the one before the
    # changed token on: its label changed) see the change, and every other token's loss is the same bit for bit.
    end_of_document_1 = DOCUMENTS[0] + DOCUMENTS[1]
    for where, losses in ((f"CP {degree}", wholes), ("one rank", one_rank)):
        moved = (losses[True] != losses[False]).nonzero().tolist()
        assert moved and all(row == 0 and CHANGED - 1 <= col < end_of_document_1 for row, col in moved), (
            where,
            moved,
        )
