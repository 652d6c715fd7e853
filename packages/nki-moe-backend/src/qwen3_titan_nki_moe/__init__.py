"""Qwen3-MoE on torchtitan with a kernel registry: NKI kernels on Trainium, reference kernels elsewhere.

``--module qwen3_titan_nki_moe`` (config functions in ``config_registry``). :data:`BACKEND` is what the
shared ``train`` launcher knows of it (the ``qwen3_titan.backends`` entry point); kept import-light: the
launcher lists config functions without importing torch.

When the run asks for the NKI kernels (``--kernels nki``), each rank checks the resolved config
against the kernels' shape rules before it writes anything (``NkiMoETrainer.prepare_backend``), and a
broken rule ends the launch with one line::

    train: --training.seq_len 1000: the NKI rope_hf kernel needs a multiple of 256 (128 x LNC=2); nearest valid: 1024
"""

from qwen3_titan_common.launcher.plan import Backend

BACKEND = Backend(
    distribution="nki-moe-backend",
    module="qwen3_titan_nki_moe",
    default_config="debug_moe",
    eval_model="qwen3_titan_nki_moe.eval_model:nki_moe_eval_spec",
)
