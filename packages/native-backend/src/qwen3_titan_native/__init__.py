"""native-backend: torchtitan's own Qwen3 and Qwen3-MoE, trained from Hugging Face weights.

``--module qwen3_titan_native`` (config functions in ``config_registry``). :data:`BACKEND` is what the
shared ``train`` launcher knows of it (the ``qwen3_titan.backends`` entry point); kept import-light: the
launcher imports this package before it starts torchrun.
"""

from qwen3_titan_common.launcher.plan import Backend

BACKEND = Backend(
    distribution="native-backend",
    module="qwen3_titan_native",
    eval_model="qwen3_titan_common.hf.eval_models:native_qwen3",
)
