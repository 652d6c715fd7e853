"""hf-v5-backend: transformers v5 ``AutoModelForCausalLM`` trained through torchtitan.

``--module qwen3_titan_hf_v5``. :data:`BACKEND` is what the shared ``train`` launcher knows of it (the
``qwen3_titan.backends`` entry point); kept import-light: the launcher imports this package before it
starts torchrun.
"""

from qwen3_titan_common.launcher.plan import Backend

BACKEND = Backend(
    distribution="hf-v5-backend",
    module="qwen3_titan_hf_v5",
    eval_model="qwen3_titan_hf_v5.model:hf_v5_eval_spec",
)
