"""``uv run --package nki-moe-backend train``: common's launcher with this backend's NKI shape check.

The shared ``train`` script (``qwen3_titan_common.cli.launch:main``) finds :data:`BACKEND` through the
``qwen3_titan.backends`` entry point; ``python -m qwen3_titan_nki_moe.launch`` runs it directly.

When the run asks for the NKI kernels (``--kernels nki``), each rank checks the resolved config
against the kernels' shape rules before it writes anything (``NkiMoETrainer.prepare_backend``), and a
broken rule ends the launch with one line::

    train: --training.seq_len 1000: the NKI rope_hf kernel needs a multiple of 256 (128 x LNC=2); nearest valid: 1024
"""

from __future__ import annotations

from qwen3_titan_common.cli.launch import main_for
from qwen3_titan_common.cli.plan import Backend

BACKEND = Backend(
    distribution="nki-moe-backend",
    module="qwen3_titan_nki_moe",
    default_config="debug_moe",
    eval_model="qwen3_titan_nki_moe.eval_model:nki_moe_model",
)

main = main_for(BACKEND)

if __name__ == "__main__":
    main()
