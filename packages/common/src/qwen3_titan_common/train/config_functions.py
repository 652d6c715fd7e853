"""The config functions every backend offers, made once: each backend names only its model and trainer.

torchtitan finds a config function as a zero-argument callable attribute of the backend's
``config_registry`` (``--config NAME``), and the launcher lists them without importing anything
(``launcher.config_names`` reads the registry's source). A function written out is listed by its docstring;
one made here is an assignment (``qwen3_1_7b = CONFIGS.published("qwen3_1_7b")``), listed by its
``doc=`` or, for the published shapes, by the summary in ``arch.published.PUBLISHED_CONFIG_FUNCTIONS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qwen3_titan_common.arch.architecture import Qwen3Architecture
from qwen3_titan_common.arch.published import PUBLISHED_CONFIG_FUNCTIONS, published_architecture
from qwen3_titan_common.assets import default_tokenizer_dir
from qwen3_titan_common.protocols.rank_errors import record_refused_flags, record_uncaught_errors
from qwen3_titan_common.train.config import (
    RunShape,
    build_trainer_config,
    debug_shape,
    qwen3_4b_2507_checkpoint,
    real_size_shape,
)
from qwen3_titan_common.train.trainer import HFCheckpointConfig, ModelSpecBuilder, Qwen3Trainer

ConfigFunction = Callable[[], Qwen3Trainer.Config]


def _named(name: str, doc: str, build: ConfigFunction) -> ConfigFunction:
    build.__name__ = build.__qualname__ = name
    build.__doc__ = doc
    return build


@dataclass(frozen=True)
class BackendConfigs:
    """What one backend's config functions share: its short name (dump folders), model, trainer."""

    backend: str
    model_spec_builder: ModelSpecBuilder
    trainer: type[Qwen3Trainer] = Qwen3Trainer
    override_imports: tuple[str, ...] = ()
    """``@override`` factories every config of the backend lists (``--override.imports``)."""
    module: str | None = None
    """The ``--module`` these config functions are found under (the registry's package): each config
    records it with its own name, so a rank knows which function built its config without reading argv."""

    def config(
        self, arch: Qwen3Architecture, name: str, shape: RunShape, hf: HFCheckpointConfig | None = None
    ) -> Qwen3Trainer.Config:
        record_uncaught_errors()
        config = build_trainer_config(
            arch, name, self.model_spec_builder, assets_path=default_tokenizer_dir(), shape=shape, hf=hf,
            trainer=self.trainer,
        )  # fmt: skip
        config.override.imports = list(self.override_imports)
        config.config_function = (self.module, name) if self.module else None
        record_refused_flags(config)
        return config

    def tiny(self, arch: Qwen3Architecture, name: str, shape: RunShape | None = None) -> Qwen3Trainer.Config:
        """An embedded tiny model's run (``debug_shape`` unless given)."""
        return self.config(arch, name, shape or debug_shape(self.backend, name))

    def published(self, name: str) -> ConfigFunction:
        """``--config name``: a published checkpoint's shape, random init; which checkpoint, and the
        function's one-line summary, from ``arch.published.PUBLISHED_CONFIG_FUNCTIONS``."""
        hub_name, doc = PUBLISHED_CONFIG_FUNCTIONS[name]

        def build() -> Qwen3Trainer.Config:
            return self.config(published_architecture(hub_name), name, real_size_shape(self.backend, name))

        return _named(name, doc, build)

    def recipe_4b_2507(self, name: str, *, doc: str) -> ConfigFunction:
        """``--config name``: the recipe's Qwen3-4B-Instruct-2507 from its local directory (assets/hf/)."""

        def build() -> Qwen3Trainer.Config:
            arch = published_architecture("Qwen3-4B-Instruct-2507")
            return self.config(arch, name, real_size_shape(self.backend, name), qwen3_4b_2507_checkpoint())

        return _named(name, doc, build)
