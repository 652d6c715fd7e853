"""Tensor parallelism (with sequence parallelism) for the transformers model, in torch's own plan styles.

transformers v5 plans Qwen3's tensor parallelism itself (``Qwen3Config.base_model_tp_plan``): q/k/v and the
MLP's gate/up projections column-wise, o_proj and down_proj row-wise, the per-head q/k norms replicated with
their gradients summed. Here the same plan is laid out with ``torch.distributed.tensor.parallel`` styles, as
torchtitan lays out its own models, so that the weights are DTensors on the ``tp`` mesh that FSDP2, the
checkpointer and torchtitan's gradient clipping already take:

* ``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``: :class:`ColwiseParallel` (each rank its heads,
  its share of the MLP's hidden width); ``o_proj``/``down_proj``: :class:`RowwiseParallel`, their sum
  reduce-scattered along the sequence.
* ``q_norm``/``k_norm`` act per head on ``(batch, seq, heads, head_dim)``: replicated weights over inputs
  sharded by heads (``SequenceParallel(sequence_dim=2)``), so their gradients are summed over the ranks.
* Sequence parallelism (``--parallelism.enable_sequence_parallel``, torchtitan's default): between the
  attention and MLP blocks the residual stream is split along the sequence, and the layer norms run on
  each rank's share; the attention and the MLP gather it back. Off, the residual stream is whole on every rank
  (transformers' plan).
* The embedding is split by vocabulary rows and its output summed whole (not reduce-scattered): the decoder
  stack builds RoPE's tables and the attention masks from the embedded rows, so it sees them whole; the
  first decoder layer takes its share of the sequence (a local slice, gathered back in the backward).
* The final norm's output is gathered whole, and ``lm_head`` is column-wise along the vocabulary: torchtitan's
  chunked loss cuts the rows into chunks beside their labels, and its cross-entropy is vocabulary-parallel on
  the local logits (its ``spmd_types`` path), or on ``Shard(-1)`` DTensor logits (``partial_dtensor``).
* A tied ``lm_head`` shares the embedding's weight: both are sharded by vocabulary rows (``Shard(0)``), so
  the one DTensor serves both, and the tie is restored after the plan made each module its own Parameter.

A Qwen3-MoE directory's experts are refused with tensor parallelism (``parallelize.check_parallelism``).
"""

from __future__ import annotations

import warnings

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torchtitan.tools.logging import logger


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, local_logits: bool
) -> None:
    """Lay ``model`` (an ``HFCausalLM``) out over ``tp_mesh``. ``local_logits``: ``lm_head`` returns this
    rank's vocabulary shard as a plain tensor (torchtitan's ``spmd_types`` loss), else a ``Shard(-1)``
    DTensor (``partial_dtensor``)."""
    decoder = model.model
    embedding, norm, lm_head = decoder.embed_tokens, decoder.norm, model.lm_head
    tied = embedding is not None and lm_head is not None and lm_head.weight is embedding.weight
    # Between the blocks: the residual stream's layout, and what the norms and block outputs are.
    stream = Shard(1) if sequence_parallel else Replicate()
    if embedding is not None:
        parallelize_module(
            embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        )
    layers = decoder_layers(model)
    for layer in layers:
        plan = {
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": stream},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "self_attn.o_proj": RowwiseParallel(output_layouts=stream),
            "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan["input_layernorm"] = SequenceParallel()
            plan["post_attention_layernorm"] = SequenceParallel()
        else:
            _replicate(layer.input_layernorm, tp_mesh)
            _replicate(layer.post_attention_layernorm, tp_mesh)
        parallelize_module(layer, tp_mesh, plan)
    if sequence_parallel and layers:
        # Rows arrive whole (embedded, or from the previous pipeline stage); the first layer keeps its share,
        # its residual included. A pipeline stage before the last hands its rows on whole.
        parallelize_module(
            layers[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
        )
        if norm is None:
            parallelize_module(layers[-1], tp_mesh, _gathered(Shard(1)))
    if norm is not None:
        if sequence_parallel and not layers:
            # A last pipeline stage holding no decoder layer: the rows arrive whole, and the norm takes its share.
            parallelize_module(
                norm,
                tp_mesh,
                PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
            )
        if sequence_parallel:
            parallelize_module(norm, tp_mesh, SequenceParallel())
        else:
            _replicate(norm, tp_mesh)
        parallelize_module(norm, tp_mesh, _gathered(stream))
    if lm_head is not None:
        parallelize_module(
            lm_head,
            tp_mesh,
            ColwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=local_logits
            ),
        )
    if tied:
        model.lm_head.weight = decoder.embed_tokens.weight
    # The gathered hidden states are a view of the DTensor's local tensor. FSDP2 warns of a root module that
    # returns a view, in case its caller changes it in place; torchtitan's chunked loss only reads it.
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDPHFCausalLM\) returned a view tensor"
    )
    logger.info(
        f"Applied tensor parallelism {tp_mesh.size()} to the transformers model"
        f"{' with sequence parallelism' if sequence_parallel else ''}: {len(layers)} decoder layers"
        f"{', embedding and lm_head by vocabulary rows' if embedding is not None or lm_head is not None else ''}"
        f"{' (tied)' if tied else ''}"
    )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model``: transformers' list, or a pipeline stage's own (``pipeline.py``)."""
    layers = model.model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def _gathered(layout) -> PrepareModuleOutput:
    """A module's output, in ``layout`` across the ranks, gathered whole on each as a plain tensor."""
    return PrepareModuleOutput(
        output_layouts=layout, desired_output_layouts=Replicate(), use_local_output=True
    )


def _replicate(norm: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A norm over a residual stream that is whole on every rank (no sequence parallelism): its weight a
    replicated DTensor, like every other weight of the layer, its input and output plain tensors."""

    def replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]), param.requires_grad)
            )

    def as_dtensor(module: nn.Module, inputs, mesh: DeviceMesh):
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) if not isinstance(x, DTensor) else x
            for x in inputs
        )

    def as_local(module: nn.Module, output, mesh: DeviceMesh):
        return output.to_local() if isinstance(output, DTensor) else output

    distribute_module(norm, tp_mesh, replicate_parameters, input_fn=as_dtensor, output_fn=as_local)
