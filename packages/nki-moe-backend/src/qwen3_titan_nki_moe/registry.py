"""The kernel registry: one place per op where its implementation is chosen.

Each op is defined once as a ``torch.library.custom_op`` (``qwen3_titan_nki_moe.ops``) and
has up to two implementations:

``reference``  plain PyTorch, on every device (CPU, CUDA, and Neuron when the NKI kernel
               cannot run): the op itself.
``nki``        our NKI kernel (``qwen3_titan_nki_moe.nki``), registered with
               ``torch_neuronx.nki_op`` + ``register_autograd``. That module is imported only
               when a Neuron device is present, so on CPU/CUDA hosts ``nki`` and
               ``torch_neuronx`` are never imported.

The mode comes from ``--kernels`` (trainer config), else ``QWEN3_TITAN_KERNELS``, else
``auto``:

``auto``       NKI on Trainium where the op's shape rules hold (``constraints``), reference
               everywhere else;
``reference``  reference everywhere;
``nki``        NKI for every op: fails fast, on any device, when a shape rule is broken,
               and fails when no Neuron device is present.

The choice is made once per process and logged, one line per op, e.g.
``[kernels] rope_hf: reference (no Neuron device)``. Modules look their op up on every
call (:func:`get`), so configuring before the model runs is all it takes.

Users add ops with :func:`register` (see ``examples/my_neuron_kernels``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from qwen3_titan_common.errors import UserInputError
from torchtitan.tools.logging import logger

from qwen3_titan_nki_moe import constraints
from qwen3_titan_nki_moe.ops import grouped_swiglu as _grouped_swiglu_ops
from qwen3_titan_nki_moe.ops import rms_norm as _rms_norm_ops  # noqa: F401  (registers the op)
from qwen3_titan_nki_moe.ops import rope_hf as _rope_hf_ops  # noqa: F401  (registers the op)

KERNELS_ENV = "QWEN3_TITAN_KERNELS"
MODES = ("auto", "reference", "nki")
LOG_PREFIX = "[kernels]"


class KernelSelectionError(UserInputError):
    """The requested kernels cannot run here; one line saying what to do instead."""


@dataclass(frozen=True)
class KernelOp:
    name: str
    reference: Callable
    # "package.module:attribute", imported only on a Neuron host; None: reference only.
    nki: str | None = None
    # Extra words for the reference's log line on this device kind ("cpu", "cuda", "neuron").
    reference_detail: Callable[[str], str] | None = None


@dataclass(frozen=True)
class Choice:
    op: str
    implementation: str  # "reference" | "nki"
    reason: str
    fn: Callable = field(repr=False, compare=False)

    def line(self) -> str:
        return f"{LOG_PREFIX} {self.op}: {self.implementation} ({self.reason})"


_OPS: dict[str, KernelOp] = {}
_choices: dict[str, Choice] | None = None
# The last configure() arguments: an op registered afterwards is chosen under the same settings.
_settings: dict = {}


def register(
    name: str,
    *,
    reference: Callable,
    nki: str | None = None,
    reference_detail: Callable[[str], str] | None = None,
) -> None:
    """Add (or replace) an op. ``nki`` names the NKI implementation as ``module:attribute``."""
    global _choices
    if nki is not None and ":" not in nki:
        raise ValueError(f"register({name!r}, nki={nki!r}): expected 'package.module:attribute'")
    _OPS[name] = KernelOp(name, reference, nki, reference_detail)
    _choices = None  # re-chosen (and re-logged) on next use


def registered() -> dict[str, KernelOp]:
    return dict(_OPS)


def _mode_and_source(explicit: str | None) -> tuple[str, str]:
    """The mode and where it came from (the flag or the environment), for messages."""
    if explicit not in (None, "auto"):
        mode, source = explicit, f"--kernels {explicit}"
    else:
        mode = os.environ.get(KERNELS_ENV, "auto").strip() or "auto"
        source = f"{KERNELS_ENV}={mode}" if mode != "auto" else "--kernels auto"
    if mode not in MODES:
        flag = "--kernels" if explicit not in (None, "auto") else KERNELS_ENV
        raise KernelSelectionError(f"{flag}={mode!r}: expected one of {', '.join(MODES)}")
    return mode, source


def requested_mode(explicit: str | None = None) -> str:
    """``explicit`` (a ``--kernels`` value other than the default) wins, then the environment."""
    return _mode_and_source(explicit)[0]


def _load(target: str) -> Callable:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def configure(
    mode: str | None = None,
    shape: constraints.KernelShape | None = None,
    *,
    device_kind: str | None = None,
    log: bool = True,
) -> dict[str, Choice]:
    """Choose every op's implementation now (see the module docstring) and log the choices.

    ``shape`` enables the NKI shape rules: a broken rule is an error under ``nki`` and a
    fallback to the reference under ``auto``. ``device_kind`` overrides device detection
    (tests); by default ``qwen3_titan_common.runtime.device.detect_device`` decides.
    """
    global _choices
    _settings.update(mode=mode, shape=shape, device_kind=device_kind)
    mode, source = _mode_and_source(mode)
    if mode == "nki" and shape is not None:
        constraints.check(shape)
    reason_no_neuron = None
    if device_kind is None:
        from qwen3_titan_common.runtime.device import detect_device

        device = detect_device()
        device_kind = device.kind
        if device.kind != "neuron":
            reason_no_neuron = device.reason if device.reason.startswith("QWEN3_TITAN_DEVICE") else None
    reason_no_neuron = reason_no_neuron or "no Neuron device"
    if mode == "nki" and device_kind != "neuron":
        raise KernelSelectionError(
            f"{source}: {reason_no_neuron}; the NKI kernels run on Trainium only "
            "(use --kernels auto or reference here)"
        )
    broken = constraints.violations_by_op(shape) if shape is not None else {}

    chosen: dict[str, Choice] = {}
    for op in _OPS.values():
        chosen[op.name] = _choose(op, mode, source, device_kind, reason_no_neuron, broken.get(op.name, []))
    _choices = chosen
    if log:
        for choice in chosen.values():
            logger.info(choice.line())
    return dict(chosen)


def _choose(
    op: KernelOp,
    mode: str,
    source: str,
    device_kind: str,
    reason_no_neuron: str,
    broken: list[constraints.Violation],
) -> Choice:
    def reference(reason: str) -> Choice:
        if op.reference_detail is not None:
            reason = f"{reason}; {op.reference_detail(device_kind)}"
        return Choice(op.name, "reference", reason, op.reference)

    if mode == "reference":
        return reference(source)
    if device_kind != "neuron":
        return reference(reason_no_neuron)
    if op.nki is None:
        return reference("no NKI kernel registered")
    if broken:
        # Only reachable under auto: nki mode checked the rules before.
        return reference(f"auto: {broken[0].message()}")
    try:
        fn = _load(op.nki)
    except Exception as err:
        if mode == "nki":
            raise KernelSelectionError(f"{source}: loading the NKI {op.name} kernel failed: {err}") from err
        return reference(f"auto: loading the NKI kernel failed: {err}")
    return Choice(op.name, "nki", "Neuron device present", fn)


def choices() -> dict[str, Choice]:
    """The current choices (configuring first if needed, with the last settings or the defaults)."""
    if _choices is None:
        configure(**_settings)
    assert _choices is not None
    return dict(_choices)


def get(name: str) -> Callable:
    """The implementation of op ``name`` chosen for this process."""
    current = _choices if _choices is not None else choices()
    try:
        return current[name].fn
    except KeyError:
        raise KeyError(f"kernel op {name!r} is not registered; registered: {', '.join(_OPS)}") from None


def reset() -> None:
    """Forget the choices and settings (the next :func:`get` configures again, with the defaults)."""
    global _choices
    _choices = None
    _settings.clear()


register(
    "grouped_swiglu",
    reference=_grouped_swiglu_ops.reference,
    nki="qwen3_titan_nki_moe.nki.grouped_swiglu:grouped_swiglu",
    reference_detail=_grouped_swiglu_ops.grouped_gemm_summary,
)
register("rope_hf", reference=torch.ops.qwen3_titan.rope_hf, nki="qwen3_titan_nki_moe.nki.rope_hf:rope_hf")
register(
    "rms_norm", reference=torch.ops.qwen3_titan.rms_norm, nki="qwen3_titan_nki_moe.nki.rms_norm:rms_norm"
)
