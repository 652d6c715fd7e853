"""Expert parallelism for a transformers Qwen3-MoE: each rank holds ``E / ep`` of every layer's experts.

transformers v5 keeps a layer's experts fused (``Qwen3MoeExperts``: ``gate_up_proj`` ``(E, 2F, D)`` and
``down_proj`` ``(E, D, F)``), called by its sparse MoE block with the layer's tokens, each token's top-k
experts and their routing weights. Under ``--parallelism.expert_parallel_degree`` each experts module is
replaced by :class:`ExpertParallelExperts`, which takes over the same two parameters under the same names
(``model.layers.N.mlp.experts.gate_up_proj``), sharded by experts (``Shard(0)`` on the ``ep`` mesh), and is
called the same way. Its forward exchanges the tokens with the token dispatcher the native MoE uses
(``models.ep_dispatch``: on the CPU exactly the routed rows, on Neuron or with ``--moe.capacity_factor`` a
fixed capacity; torchtitan's all-to-all on CUDA), runs this rank's experts on the rows they received, and
sends the outputs home, where they are weighted by the routing scores and summed per token. The router, its
routing and the block around it stay transformers'.

Tensor names as in ``models.ep_dispatch``: T tokens of this rank, K top-k, E experts, e experts of this rank,
R rows received, D model width, F an expert's hidden width.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from qwen3_titan_common.models.ep_dispatch import CapacityTokenDispatcher
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torchtitan.tools.logging import logger


class ExpertParallelExperts(nn.Module):
    """A transformers experts module's weights over the expert-parallel ranks (module docstring)."""

    def __init__(self, experts: nn.Module, dispatcher, ep_mesh: DeviceMesh):
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        self.token_dispatcher = dispatcher
        self.token_dispatcher.wire_meshes(ep_mesh=ep_mesh)

    def forward(
        self, hidden_TD: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor
    ) -> torch.Tensor:
        with torch.no_grad():  # (E,) assignments per expert, in one shape whatever the routing
            expert_N = top_k_index_TK.reshape(-1)
            counts_E = expert_N.new_zeros(self.num_experts).index_add_(0, expert_N, torch.ones_like(expert_N))
        routed_RD, rows_e, metadata = self.token_dispatcher.dispatch(
            hidden_TD, top_k_weights_TK, top_k_index_TK, counts_E
        )
        gate_up_eFD, down_eDF = (_local(p) for p in (self.gate_up_proj, self.down_proj))
        if isinstance(self.token_dispatcher, CapacityTokenDispatcher):
            # The same rows for every expert, on every step: one batched product, one shape (Neuron).
            out_RD = self._batched(routed_RD, gate_up_eFD, down_eDF)
        else:
            out_RD = self._per_expert(routed_RD, rows_e.tolist(), gate_up_eFD, down_eDF)
        return self.token_dispatcher.combine(out_RD, metadata, hidden_TD)

    def _per_expert(self, routed_RD, rows: list[int], gate_up_eFD, down_eDF) -> torch.Tensor:
        """Each local expert's SwiGLU on its ``rows[i]`` rows, as transformers' experts compute one."""
        outputs = []
        for expert, rows_XD in enumerate(torch.split(routed_RD, rows)):
            gate_XF, up_XF = nn.functional.linear(rows_XD, gate_up_eFD[expert]).chunk(2, dim=-1)
            outputs.append(nn.functional.linear(self.act_fn(gate_XF) * up_XF, down_eDF[expert]))
        return torch.cat(outputs)

    def _batched(self, routed_RD, gate_up_eFD, down_eDF) -> torch.Tensor:
        """The same SwiGLU with every local expert's rows in one batched product (a fixed capacity of rows each,
        zero rows where fewer were routed: their output is zero)."""
        e, D = gate_up_eFD.shape[0], routed_RD.shape[-1]
        rows_eXD = routed_RD.view(e, -1, D)
        gate_eXF, up_eXF = torch.bmm(rows_eXD, gate_up_eFD.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(self.act_fn(gate_eXF) * up_eXF, down_eDF.transpose(1, 2)).reshape(-1, D)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a parameter sharded over the ``ep`` mesh (gathered by FSDP2 along the data
    ranks before the forward)."""
    return param.to_local() if isinstance(param, DTensor) else param


def apply_expert_parallel(ep_mesh: DeviceMesh, dispatcher_config, layers) -> int:
    """Replace the experts of every MoE layer in ``layers`` with :class:`ExpertParallelExperts` over
    ``ep_mesh``, each with its own dispatcher built from ``dispatcher_config``; returns how many."""
    if dispatcher_config is None:
        raise ValueError(
            "--parallelism.expert_parallel_degree: the model config has no token dispatcher (HFCausalLM.Config."
            "token_dispatcher, set by hf_v5_model_spec for a Qwen3-MoE config.json)"
        )
    replaced = 0
    for layer in layers:
        mlp = layer.mlp
        experts = getattr(mlp, "experts", None)
        if experts is None:
            continue  # a dense layer of a model that mixes them (mlp_only_layers, decoder_sparse_step)
        mlp.experts = ExpertParallelExperts(experts, dispatcher_config.build(), ep_mesh)
        replaced += 1
    logger.info(
        f"Applied expert parallelism {ep_mesh.size()} to the transformers model: the experts of {replaced} layers, "
        f"{type(dispatcher_config).__qualname__.split('.')[0]} token exchange"
    )
    return replaced
