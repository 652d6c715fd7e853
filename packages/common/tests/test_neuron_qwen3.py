from importlib.metadata import entry_points

import pytest
from neuron_qwen3 import config_registry as recipes
from qwen3_titan_common.launcher.launch import run
from qwen3_titan_common.launcher.plan import Backend


def _installed(name: str) -> bool:
    return bool(entry_points(group=recipes.RECIPE_GROUP, name=name))


def test_every_recipe_name_has_a_provider_and_a_function():
    for name in recipes.RECIPE_PROVIDERS:
        assert callable(getattr(recipes, name))


def test_a_missing_backend_names_the_package_to_install():
    missing = [n for n in recipes.RECIPE_PROVIDERS if not _installed(n)]
    if not missing:
        pytest.skip("every backend is installed in this environment: nothing is missing")
    name = missing[0]
    package = recipes.RECIPE_PROVIDERS[name]
    with pytest.raises(recipes.BackendNotInstalledError, match=f"'{package}' package"):
        getattr(recipes, name)()
    # A RuntimeError, not an ImportError: torchtitan would swallow the latter.
    assert not issubclass(recipes.BackendNotInstalledError, ImportError)


def test_launcher_reports_a_missing_backend_before_launching(capsys):
    missing = [n for n in recipes.RECIPE_PROVIDERS if not _installed(n)]
    if not missing:
        pytest.skip("every backend is installed in this environment: nothing is missing")
    backend = Backend(distribution="common", module="neuron_qwen3", default_config=missing[0])
    assert run(backend, ["--nproc", "1"]) == 2
    assert f"uv sync --package {recipes.RECIPE_PROVIDERS[missing[0]]}" in capsys.readouterr().err


def test_installed_recipe_resolves_to_a_trainer_config():
    if not _installed("native_qwen3_4b"):
        pytest.skip("native-backend is not installed in this environment")
    config = recipes.native_qwen3_4b()
    rope = config.model_spec.model.layers[0].attention.rope
    assert rope.theta == 5_000_000.0
