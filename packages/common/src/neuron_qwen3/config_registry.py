"""Recipe config names (``--module neuron_qwen3 --config NAME``).

Each function forwards to the backend package that provides it. torchtitan hides
ImportErrors raised while importing a config registry, so a missing backend is
reported at call time with a RuntimeError that names the package to install.
"""

from __future__ import annotations

from importlib.metadata import entry_points as _entry_points

RECIPE_GROUP = "qwen3_titan.recipes"

# Which distribution provides each recipe name, for the error when it is absent.
RECIPE_PROVIDERS = {
    "v5_qwen3_4b": "hf-v5-backend",
    "native_qwen3_4b": "native-backend",
    "qwen3_nki_moe_config": "nki-moe-backend",
}


class BackendNotInstalledError(RuntimeError):
    pass


def missing_provider(name: str) -> str | None:
    """The distribution to install for recipe ``name``, or None when it is installed."""
    if _entry_points(group=RECIPE_GROUP, name=name):
        return None
    return RECIPE_PROVIDERS[name]


def missing_provider_message(name: str) -> str | None:
    """The one line for recipe ``name`` whose backend is not installed, or None when it is."""
    package = missing_provider(name)
    if package is None:
        return None
    return (
        f"--config {name} is provided by the '{package}' package, which is not installed in this "
        f"environment: run `uv sync --package {package}` (or `uv run --package {package} train ...`)"
    )


def _resolve(name: str):
    message = missing_provider_message(name)
    if message is not None:
        raise BackendNotInstalledError(message)
    return next(iter(_entry_points(group=RECIPE_GROUP, name=name))).load()()


def v5_qwen3_4b():
    """Qwen3-4B-Instruct-2507 through transformers v5 (hf-v5-backend)."""
    return _resolve("v5_qwen3_4b")


def native_qwen3_4b():
    """Qwen3-4B-Instruct-2507 on torchtitan's native Qwen3 (native-backend)."""
    return _resolve("native_qwen3_4b")


def qwen3_nki_moe_config():
    """Qwen3-MoE with NKI kernels on Trainium, reference kernels elsewhere (nki-moe-backend)."""
    return _resolve("qwen3_nki_moe_config")
