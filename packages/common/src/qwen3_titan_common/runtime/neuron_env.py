"""The Neuron runtime environment, set in one place.

A trn2.48xlarge has 16 Trainium2 chips with 8 physical NeuronCores each. At the
default logical-core configuration LNC=2, two physical cores act as one logical
core: 64 logical NeuronCores, hence 64 ranks (``--nproc_per_node=64``).

``NEURON_LOGICAL_NC_CONFIG``  logical core size (2 on trn2); NKI kernels launched
                              with ``kernel[(lnc,)]`` must use the same value.
``NEURON_RT_NUM_CORES``       not set: each rank gets its own logical core from
                              torchrun's LOCAL_RANK through the plugin.
``NEURON_COMPILE_CACHE_URL``  compiled graphs (NEFFs) are cached here so the
                              minutes of first-step compilation are paid once.

Values the user has already exported win; we only fill in what is missing.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

LOGICAL_CORE_SIZE = 2
LOGICAL_CORES_PER_TRN2_48XL = 64

NEURON_ENV_DEFAULTS: dict[str, str] = {
    "NEURON_LOGICAL_NC_CONFIG": str(LOGICAL_CORE_SIZE),
    "NEURON_COMPILE_CACHE_URL": os.path.join(os.path.expanduser("~"), ".cache", "neuron-compile-cache"),
    # Fail on a graph that does not compile rather than silently running it on CPU.
    "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS": "0",
}


def logical_core_size(env: MutableMapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    return int(env.get("NEURON_LOGICAL_NC_CONFIG", LOGICAL_CORE_SIZE))


def neuron_env_updates(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to ``env`` for a Neuron run (never overriding the user's)."""
    env = os.environ if env is None else env
    return {k: v for k, v in NEURON_ENV_DEFAULTS.items() if k not in env}
