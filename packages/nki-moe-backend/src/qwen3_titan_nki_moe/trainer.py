"""The backend's trainer: common's ``Qwen3Trainer`` plus kernel selection.

``NkiMoETrainer.Config`` adds one field to ``Qwen3Trainer.Config``:

    --kernels {auto,reference,nki}   auto: NKI on Trainium, reference elsewhere (default)

On the run's resolved config (``--hf.model_dir``'s architecture in it), before anything is written
and before distributed init, ``prepare_backend``

1. expands bare-module ``--override.imports`` entries and adds the backend's kernel
   overrides for components the list leaves unclaimed (``override_imports``);
2. under ``--kernels nki`` checks the NKI kernels' shape rules (``constraints``);
3. chooses each op's implementation and logs it, one line per op (``registry``);
4. writes the mode and the run's kernel shape into the ``override.imports`` entries whose
   factories take them, as torchtitan's entry kwargs: ``apply_overrides`` hands them to the
   factories, so every kernel module's ``Config`` carries the mode and the module makes the
   same choice when it is built.

The config functions in ``config_registry`` return this Config, so the Config class picks
this trainer; ``--module neuron_qwen3 --config qwen3_nki_moe_config`` does too.
"""

from __future__ import annotations

from dataclasses import dataclass

from qwen3_titan_common.train.trainer import Qwen3Trainer
from torchtitan.tools.logging import logger

from qwen3_titan_nki_moe import constraints, override_imports, registry
from qwen3_titan_nki_moe.overrides import KERNEL_OVERRIDES
from qwen3_titan_nki_moe.registry import KernelMode


class NkiMoETrainer(Qwen3Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3Trainer.Config):
        kernels: KernelMode = "auto"
        """Kernel implementations: auto (NKI on Trainium where the shape rules hold, reference
        elsewhere), reference, or nki (fail unless every NKI kernel can run)."""

    @classmethod
    def prepare_backend(cls, config: Config) -> None:
        super().prepare_backend(config)
        prepare_kernels(config)

    @classmethod
    def cuda_graph_blocker(cls, config: Config) -> str | None:
        import torch
        from torchtitan.config import TORCH_DTYPE_MAP

        from qwen3_titan_nki_moe.ops.grouped_swiglu import grouped_mm_plan

        # Under FSDP mixed precision the experts compute in the parameter dtype.
        dtype = TORCH_DTYPE_MAP[config.training.mixed_precision_param]
        grouped, how = grouped_mm_plan(torch.device("cuda", torch.cuda.current_device()), dtype)
        if grouped:
            return None
        return f"the routed experts' reference kernel reads each expert's row count on the host ({how})"


def prepare_kernels(config) -> dict[str, registry.Choice]:
    """Steps 1-4 of the module docstring; raises with a one-line message on a bad request."""
    imports, lines = override_imports.expand(config.override.imports)
    imports, more = override_imports.complete(imports, KERNEL_OVERRIDES)
    for line in lines + more:
        logger.info(line)
    shape = constraints.kernel_shape(config)
    # After the expansion: a user's module registers its ops when imported, and is logged too.
    chosen = registry.choose_all(config.kernels, shape)
    config.override.imports = override_imports.pass_kwargs(
        imports, {"kernels": config.kernels, "kernel_shape": shape}
    )
    for choice in chosen.values():
        logger.info(choice.line())
    return chosen
