"""The torchtitan ``ModelSpec`` of a transformers v5 model shaped by a ``config.json``."""

from __future__ import annotations

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.perf.flops import FlopsConvention
from qwen3_titan_common.runtime.fsdp_comms import reducing_over_gloo_with_sum
from torchtitan.protocols.model_spec import ModelSpec

from qwen3_titan_hf_v5.model import HFCausalLM
from qwen3_titan_hf_v5.parallelize import parallelize_hf_v5
from qwen3_titan_hf_v5.state_dict_adapter import HFv5StateDictAdapter


def hf_v5_model_spec(arch: Qwen3Architecture, flavor: str) -> ModelSpec:
    """``arch.source`` is the config.json transformers builds the model from."""
    return ModelSpec(
        name="hf_v5",
        flavor=flavor,
        model=HFCausalLM.Config(hf_config=dict(arch.source), flops=FlopsConvention(arch)),
        parallelize_fn=reducing_over_gloo_with_sum(parallelize_hf_v5),
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=HFv5StateDictAdapter,
    )
