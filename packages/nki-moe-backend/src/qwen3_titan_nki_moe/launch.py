"""``uv run --package nki-moe-backend train``: common's launcher with this backend's NKI shape check.

The shared ``train`` script (``qwen3_titan_common.cli.launch:main``) finds :data:`BACKEND` through the
``qwen3_titan.backends`` entry point; ``python -m qwen3_titan_nki_moe.launch`` runs it directly.

When the run asks for the NKI kernels (``--kernels nki``, read from the config the launcher parses
once from the command line for all its checks), the resolved config is checked against the kernels'
shape rules before torchrun starts any rank (:func:`nki_precheck`, the backend's ``preflight``), and a
broken rule ends the launch with one line::

    train: --training.seq_len 1000: the NKI rope_hf kernel needs a multiple of 256 (128 x LNC=2); nearest valid: 1024

The trainer runs the same check, so the upstream ``torchrun ... -m torchtitan.train`` form fails
the same way (inside the rank, before distributed init).
"""

from __future__ import annotations

from qwen3_titan_common.cli.launch import main_for
from qwen3_titan_common.cli.plan import Backend


def nki_precheck(config) -> str | None:
    """The one-line error for an NKI request whose shapes the kernels cannot run, else None.

    ``config`` is the run's config as the launcher parsed it once for all its checks
    (``qwen3_titan_common.cli.launch_checks``).
    """
    from qwen3_titan_nki_moe import constraints

    if getattr(config, "kernels", None) != "nki" or getattr(config, "model_spec", None) is None:
        return None
    found = constraints.violations(constraints.kernel_shape(config))
    return found[0].message() if found else None


BACKEND = Backend(
    distribution="nki-moe-backend",
    module="qwen3_titan_nki_moe",
    default_config="debug_moe",
    preflight=nki_precheck,
    eval_model="qwen3_titan_nki_moe.eval_model:nki_moe_model",
)

main = main_for(BACKEND)

if __name__ == "__main__":
    main()
