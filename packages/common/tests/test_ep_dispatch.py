"""Our expert-parallel exchanges compute what one rank computes: outputs and gradients.

Both the exchange of exactly the routed rows (the CPU's default) and the fixed-capacity one (Neuron's). Two
real gloo processes (the CPU's collectives) each hold half the tokens and half the experts; one process
computes the same tokens through torchtitan's local dispatcher with every expert. Expert parallelism bugs
often give right losses and wrong gradients, so the gradients of the tokens, the routing scores and each
expert's weights are compared, and dropped assignments (over capacity) must add exactly nothing.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from qwen3_titan_common.models.ep_dispatch import CapacityTokenDispatcher, ExactTokenDispatcher
from qwen3_titan_common.train.tolerance import assert_close_reduction
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

E, K, T, D, RANKS = 4, 2, 6, 8, 2  # experts, top-k, tokens per rank, width, expert-parallel ranks


def _inputs():
    generator = torch.Generator().manual_seed(0)
    x_TD = torch.randn(RANKS * T, D, generator=generator)
    scores_TK = torch.rand(RANKS * T, K, generator=generator)
    # Skewed routing: expert 0 is every token's first choice, so a small capacity drops assignments.
    second = torch.randint(1, E, (RANKS * T,), generator=generator)
    ids_TK = torch.stack([torch.zeros_like(second), second], dim=1)
    w_EDD = torch.randn(E, D, D, generator=generator) / math.sqrt(D)
    return x_TD, scores_TK, ids_TK, w_EDD


def _experts(routed_RD, counts_e, w_eDD):
    """Each expert's rows times its weight: what grouped experts compute, one expert at a time."""
    outputs, start = [], 0
    for expert, count in enumerate(counts_e.tolist()):
        outputs.append(routed_RD[start : start + count] @ w_eDD[expert])
        start += count
    return torch.cat(outputs)


def _kept_TK(ids_TK, capacity: int):
    """Which assignments a rank keeps: per expert, the first ``capacity`` in (token, k) order."""
    kept = torch.zeros_like(ids_TK, dtype=torch.bool)
    seen = [0] * E
    for token in range(ids_TK.shape[0]):
        for k in range(K):
            expert = int(ids_TK[token, k])
            kept[token, k] = seen[expert] < capacity
            seen[expert] += 1
    return kept


def _dispatcher(capacity_factor: float | None):
    if capacity_factor is None:
        return ExactTokenDispatcher(ExactTokenDispatcher.Config(num_experts=E, top_k=K))
    return CapacityTokenDispatcher(
        CapacityTokenDispatcher.Config(num_experts=E, top_k=K, capacity_factor=capacity_factor)
    )


def _reference(capacity_factor: float | None):
    """One process, every expert: the local dispatcher, with each rank's over-capacity assignments removed."""
    x_TD, scores_TK, ids_TK, w_EDD = (t.clone().requires_grad_(t.is_floating_point()) for t in _inputs())
    capacity = T if capacity_factor is None else _dispatcher(capacity_factor).capacity(T)
    kept_TK = torch.cat([_kept_TK(ids_TK[r * T : (r + 1) * T], capacity) for r in range(RANKS)])
    local = LocalTokenDispatcher(LocalTokenDispatcher.Config(num_experts=E, top_k=K))
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
    routed, counts, metadata = local.dispatch(x_TD, scores_TK * kept_TK, ids_TK, counts_E)
    out_TD = local.combine(_experts(routed, counts, w_EDD), metadata, x_TD)
    (out_TD * torch.arange(out_TD.numel()).reshape(out_TD.shape).sin()).sum().backward()
    return out_TD.detach(), x_TD.grad, scores_TK.grad * kept_TK, w_EDD.grad, int((~kept_TK).sum())


def _rank(rank: int, store_path: str, capacity_factor: float | None, results):
    # Outside a model torchtitan has no spmd_types mesh to name the exchange's group by; the exchanges are
    # the same hooks on either path (a real spmd_types run: tests/test_parallel_layouts.py).
    set_spmd_backend("partial_dtensor")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, RANKS), rank=rank, world_size=RANKS)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (RANKS,), mesh_dim_names=("ep",))
        x_all, scores_all, ids_all, w_all = _inputs()
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * E // RANKS, (rank + 1) * E // RANKS)
        x_TD = x_all[mine].clone().requires_grad_()
        scores_TK = scores_all[mine].clone().requires_grad_()
        ids_TK = ids_all[mine]
        w_eDD = w_all[experts].clone().requires_grad_()
        dispatcher = _dispatcher(capacity_factor)
        dispatcher.wire_meshes(ep_mesh=mesh)
        counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)

        def layer(x_TD, scores_TK, w_eDD):
            routed, counts, metadata = dispatcher.dispatch(x_TD, scores_TK, ids_TK, counts_E)
            return dispatcher.combine(_experts(routed, counts, w_eDD), metadata, x_TD), counts

        out_TD, counts = layer(x_TD, scores_TK, w_eDD)
        weights = torch.arange(RANKS * T * D).reshape(RANKS * T, D)[mine].sin()
        (out_TD * weights).sum().backward()
        if capacity_factor is None:
            results[rank] = (out_TD.detach(), x_TD.grad, scores_TK.grad, w_eDD.grad, 0, int(counts.sum()))
            return
        taken = dispatcher.take_dropped()
        # Counted once per training forward: a forward without gradients (validation) counts nothing, and one
        # whose activations are recomputed in the backward (activation checkpointing) counts as one forward.
        with torch.no_grad():
            layer(x_TD, scores_TK, w_eDD)
        not_trained = dispatcher.take_dropped()
        recomputed_TD, _ = torch.utils.checkpoint.checkpoint(
            layer, x_TD, scores_TK, w_eDD, use_reentrant=False
        )
        (recomputed_TD * weights).sum().backward()
        results[rank] = (out_TD.detach(), x_TD.grad / 2, scores_TK.grad / 2, w_eDD.grad / 2, *taken)
        results[rank, "counts"] = (not_trained, dispatcher.take_dropped(), taken)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("capacity_factor", [None, E / K, 1.0], ids=["exact", "never-drops", "drops"])
def test_two_ranks_compute_what_one_rank_computes(tmp_path, capacity_factor):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _rank,
            args=(str(tmp_path / "store"), capacity_factor, results),
            nprocs=RANKS,
            start_method="spawn",
        )
        results = dict(results)
    out, dx, dscores, dw, dropped = _reference(capacity_factor)
    x_all, scores_all, _, w_all = _inputs()
    x_max, w_max, s_max = x_all.abs().max().item(), w_all.abs().max().item(), scores_all.abs().max().item()
    # The same terms added in another order (another batch of rows per matmul, another order of a token's K
    # expert rows): each result at the derived fp32 bound of its chain, with a scalar bound of sum |terms|
    # (the loss weights are sines, at most 1).
    bounds = {
        "output": ([D, K], K * D * x_max * w_max * s_max),
        "d tokens": ([D, K], K * D * w_max * s_max),
        "d scores": ([D, D], D * D * x_max * w_max),
        "d expert weights": ([RANKS * T * K], RANKS * T * K * x_max * s_max),
    }
    for rank in range(RANKS):
        mine = slice(rank * T, (rank + 1) * T)
        experts = slice(rank * E // RANKS, (rank + 1) * E // RANKS)
        got = dict(zip(bounds, results[rank][:4], strict=True))
        want = {
            "output": out[mine],
            "d tokens": dx[mine],
            "d scores": dscores[mine],
            "d expert weights": dw[experts],
        }
        for name, (lengths, abs_sum) in bounds.items():
            assert_close_reduction(got[name], want[name], lengths, abs_sum, name=f"rank {rank} {name}")
    assert sum(results[rank][4] for rank in range(RANKS)) == dropped
    # Exact: the rows this rank's experts computed; fixed capacity: the assignments this rank routed.
    assert sum(results[rank][5] for rank in range(RANKS)) == RANKS * T * K
    for rank in range(RANKS if capacity_factor is not None else 0):
        not_trained, recomputed, once = results[rank, "counts"]
        assert not_trained == (0, 0) and recomputed == once, results[rank, "counts"]
    if capacity_factor is None or capacity_factor >= E / K:
        assert dropped == 0
    else:
        assert dropped > 0  # the skewed routing overflows expert 0
