"""The kernel registry: the table of ops and the one function that chooses each op's implementation.

Each op is defined once as a ``torch.library.custom_op`` (``qwen3_titan_nki_moe.ops``) and
has up to two implementations:

``reference``  plain PyTorch, on every device (CPU, CUDA, and Neuron when the NKI kernel
               cannot run): the op itself.
``nki``        our NKI kernel (``qwen3_titan_nki_moe.nki``), registered with
               ``torch_neuronx.nki_op`` + ``register_autograd``. That module is imported only
               when a Neuron device is present, so on CPU/CUDA hosts ``nki`` and
               ``torch_neuronx`` are never imported.

:func:`choose` picks one op's implementation under a kernel mode:

``auto``       NKI on Trainium where the op's shape rules hold (``constraints``), reference
               everywhere else;
``reference``  reference everywhere;
``nki``        NKI: fails fast, on any device, when one of the op's shape rules is broken,
               and fails when no Neuron device is present.

The mode is configuration, not state kept here: each replacement module's ``Config`` carries
it (``kernels``, plus the run's :class:`~qwen3_titan_nki_moe.constraints.KernelShape`), and
the module calls :func:`choose` once, when it is built. The trainer puts ``--kernels`` into
those Configs and logs :func:`choose_all`, one line per op, e.g.
``[kernels] rope_hf: reference (no Neuron device)``.

Users add ops with :func:`register` (see ``examples/my_neuron_kernels``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from qwen3_titan_common.errors import UserInputError
from qwen3_titan_common.runtime.device import FORCE_DEVICE_ENV, DeviceInfo, detect_device

from qwen3_titan_nki_moe import constraints
from qwen3_titan_nki_moe.ops import grouped_swiglu as _grouped_swiglu_ops
from qwen3_titan_nki_moe.ops import rms_norm as _rms_norm_ops  # noqa: F401  (registers the op)
from qwen3_titan_nki_moe.ops import rope_hf as _rope_hf_ops  # noqa: F401  (registers the op)

KernelMode = Literal["auto", "reference", "nki"]
MODES: tuple[str, ...] = get_args(KernelMode)
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


def register(
    name: str,
    *,
    reference: Callable,
    nki: str | None = None,
    reference_detail: Callable[[str], str] | None = None,
) -> None:
    """Add (or replace) an op. ``nki`` names the NKI implementation as ``module:attribute``.

    Modules built afterwards see the new entry; modules already built keep their choice.
    """
    if nki is not None and ":" not in nki:
        raise ValueError(f"register({name!r}, nki={nki!r}): expected 'package.module:attribute'")
    _OPS[name] = KernelOp(name, reference, nki, reference_detail)


def registered() -> dict[str, KernelOp]:
    return dict(_OPS)


def _load(target: str) -> Callable:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _why_no_neuron(device: DeviceInfo) -> str:
    # A forced device is the user's own decision: say so; anything else is just "no device".
    return device.reason if device.reason.startswith(FORCE_DEVICE_ENV) else "no Neuron device"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise KernelSelectionError(f"--kernels {mode!r}: expected one of {', '.join(MODES)}")


def choose(
    op: str,
    mode: str,
    shape: constraints.KernelShape | None = None,
    device: DeviceInfo | None = None,
) -> Choice:
    """Op ``op``'s implementation under ``mode``; raises with a one-line message where it cannot run.

    ``shape`` enables the NKI shape rules: under ``nki`` a broken rule of this op is an error,
    under ``auto`` a fallback to the reference with the rule as the reason. ``device`` is
    this process's device (default: ``qwen3_titan_common.runtime.device.detect_device()``);
    its ``reason`` words the log line when it is not a Neuron device. Keeps nothing: the
    caller holds the :class:`Choice`. On a Neuron host it imports the op's NKI module.
    """
    _check_mode(mode)
    try:
        entry = _OPS[op]
    except KeyError:
        raise KeyError(f"kernel op {op!r} is not registered; registered: {', '.join(_OPS)}") from None
    source = f"--kernels {mode}"
    broken = constraints.violations_by_op(shape).get(op, []) if shape is not None else []
    if mode == "nki" and broken:
        raise constraints.KernelConstraintError(broken[0].message())
    device = device if device is not None else detect_device()
    if mode == "nki" and device.kind != "neuron":
        raise KernelSelectionError(
            f"{source}: {_why_no_neuron(device)}; the NKI kernels run on Trainium only "
            "(use --kernels auto or reference here)"
        )

    def reference(reason: str) -> Choice:
        if entry.reference_detail is not None:
            reason = f"{reason}; {entry.reference_detail(device.kind)}"
        return Choice(op, "reference", reason, entry.reference)

    if mode == "reference":
        return reference(source)
    if device.kind != "neuron":
        return reference(_why_no_neuron(device))
    if entry.nki is None:
        return reference("no NKI kernel registered")
    if broken:
        return reference(f"auto: {broken[0].message()}")
    try:
        fn = _load(entry.nki)
    except Exception as err:
        if mode == "nki":
            raise KernelSelectionError(f"{source}: loading the NKI {op} kernel failed: {err}") from err
        return reference(f"auto: loading the NKI kernel failed: {err}")
    return Choice(op, "nki", "Neuron device present", fn)


def choose_all(
    mode: str,
    shape: constraints.KernelShape | None = None,
    device: DeviceInfo | None = None,
) -> dict[str, Choice]:
    """Every registered op's :func:`choose`, in registration order: what the trainer logs.

    Under ``nki`` the shape rules are checked across all ops first, so the error names the
    first broken rule in ``constraints``' order whichever op it belongs to.
    """
    _check_mode(mode)
    if mode == "nki" and shape is not None:
        constraints.check(shape)
    device = device if device is not None else detect_device()
    return {name: choose(name, mode, shape, device) for name in _OPS}


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
