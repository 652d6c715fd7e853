"""Every place this project reaches into torchtitan's or torch's private names, in one version-checked module.

torchtitan's main branch broke 0.3.0's API within days of the release; when users ask for the next
torchtitan (or torch), these seams are what breaks, and nowhere else: a test
(``test_private_upstream_names_live_in_compat_only`` in ``tests/test_layering.py``) fails if a private
upstream name is used outside this file, and each seam has its own test against the installed versions
(``packages/common/tests/test_compat.py``).

One kind of private name is not a seam but part of an upstream class's design, so it is used in the
subclass, not here: the hooks a torchtitan class leaves for its subclasses, which torchtitan's own
subclasses override (``TorchFTCheckpointManager`` overrides ``CheckpointManager._save`` and ``_load``).
A subclass may override, and call on ``self`` or ``super()``, exactly the hooks :data:`SUBCLASS_HOOKS`
lists for a class it derives from; every other private name stays here. The list is checked against the
installed torchtitan like a seam, so a hook renamed upstream fails that test rather than a run.

At import the installed versions are checked (from the package metadata: nothing is imported):
torchtitan must be :data:`TORCHTITAN`, the only API these seams were written against; a torch outside
:data:`TORCH` gets one warning line (the lent GPU's image runs torch 2.11 with two polyfills, see
``tools/gpu_bench/compat``).

The seams:

- :class:`CpuDeviceModule` and :func:`use_cpu_device`: torchtitan 0.3.0 has no CPU device; its
  ``torchtitan.tools.utils`` decides ``device_type``/``device_module`` at import, and we replace both
  right after that module executes (``runtime.device_autoload``), before anything copies them; its
  ``get_peak_flops`` learns that the CPU has no peak (otherwise: ``lspci`` and an A100 fallback, warned).
- :func:`registered_override`, :func:`registered_override_names`: torchtitan keeps ``@override``
  factories in ``torchtitan.config.override._REGISTRY`` and has no public lookup.
- :func:`init_computed_buffers`: the RoPE caches of a model built on the meta device are filled by
  each module's ``_init_self_buffers``; the public ``init_states`` also draws random weights.
- :func:`hf_storage_reader_with_aliases`: torch's ``HuggingFaceStorageReader`` reads each tensor in
  ``_process_read_request``; reading one stored tensor under a second name (a tied checkpoint into an
  untied model) has no public hook.
- :func:`param_initializers`: torchtitan's ``Module`` keeps the ``param_init`` of its Config as
  ``_param_init`` and has no public accessor; the layout-independent initialisation
  (``models.layout_init``) calls each one on a whole tensor.
- :func:`without_checkpoint_wrapper`: torch's activation-checkpoint wrapper inserts
  ``_checkpoint_wrapped_module`` into parameter names.
- :func:`lm_head_applied_by_loss`, :func:`apply_lm_head_in_loss`: torchtitan's Trainer tells a model that
  its chunked loss applies ``lm_head`` by setting ``model._skip_lm_head`` (the memory estimate's step and the
  benchmarks do as the Trainer does).
- :func:`fake_tensor_mode`, :func:`step_memory_tracker`, :func:`tracker_peak_by_kind`,
  :func:`tracker_current_by_kind`, :func:`gloo_collective_copies`,
  :func:`fake_tensor_data_dependent_errors`: torch's fake tensors
  (``torch._subclasses``) and its memory trackers (``torch.distributed._tools``: ``FSDPMemTracker`` for an
  FSDP model, ``MemTracker`` otherwise), which the memory estimate (``perf.memory``) runs one step under;
  torchtitan's own estimator used them until it was removed. :func:`gloo_collective_copies` adds what gloo's
  collectives hold while they run: it names c10d's private ops and needs torch's private dispatch-mode class.
  :func:`recorded_ops` records every aten op and its outputs' shapes (the same private dispatch-mode class, and
  torch's private pytree to flatten an op's outputs).
  :func:`materialise_meta_tensors` replaces a module's meta tensors in its ``_parameters`` and ``_buffers``:
  ``to_empty`` swaps tensors, which torch refuses for a parameter something holds a weak reference to.
- :func:`cpu_flash_attention`, :func:`cpu_flash_attention_backward`: torch's fused CPU attention kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), called directly so that the
  block-sparse document attention (``models.document_blocks``) saves only its own inputs and recomputes the
  gathered keys in the backward; SDPA's public function would save each gathered copy.
- :func:`in_recomputed_forward`: whether a forward runs inside the autograd engine, as activation
  checkpointing's recomputation does (``torch._C._current_graph_task_id``; torch has no public test), so that a
  module's counts of what it saw are taken once per forward.
- :func:`raise_on_refused_command_line`: tyro's parse-error hook (``tyro._errors``, private in tyro
  :data:`TYRO`), so that a rank records a refused flag in one line as it records every other error, instead of
  tyro printing its box and exiting before any code of ours runs.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import resource
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache, partial
from importlib.metadata import PackageNotFoundError, version
from types import MappingProxyType, SimpleNamespace
from typing import Any

TORCHTITAN = "0.3.0"
TORCH = "2.14"

logger = logging.getLogger(__name__)


class UnsupportedUpstreamError(ImportError):
    """The installed torchtitan is not the one these seams were written against."""


def _installed(name: str, missing: str | None = None) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return missing


def check_versions() -> None:
    titan = _installed("torchtitan")
    if titan is not None and titan != TORCHTITAN:
        raise UnsupportedUpstreamError(
            f"torchtitan {titan} is installed; qwen3-titan supports torchtitan {TORCHTITAN} only "
            f"(its private names are used in qwen3_titan_common/compat.py): `uv sync --locked` installs it"
        )
    torch_version = _installed("torch")
    if torch_version is not None and not torch_version.startswith(TORCH + "."):
        logger.warning(
            f"[compat] torch {torch_version} is installed; qwen3-titan is tested with torch {TORCH} "
            "(torchtitan 0.3.0 targets it)"
        )


check_versions()


# -- hooks upstream classes leave for their subclasses ---------------------------------------------

SUBCLASS_HOOKS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        # save()/load() check `enable` once, then call _save/_load; _save writes when _should_save says so, then
        # purges old steps (_purge_stale_checkpoints, when _should_purge; torchft's subclass overrides the latter).
        "torchtitan.components.checkpoint.CheckpointManager": (
            "_save",
            "_load",
            "_should_save",
            "_purge_stale_checkpoints",
            "_should_purge",
            # load() without a step asks it which step folder to read.
            "_find_load_step",
        ),
        # init_states() calls _init_self_buffers for the buffers a module computes (RoPE caches); the
        # protocol's docstring names it as the override point.
        "torchtitan.protocols.module.Module": ("_init_self_buffers",),
        # Each RoPE format (ComplexRoPE, CosSinRoPE) is a subclass overriding how its cache is computed.
        "torchtitan.models.common.rope.RoPE": ("_precompute_cache",),
        # dispatch()/combine() call each of the exchange's collectives through its own method, split out (its
        # docstring says) so that graph passes can wrap them; the graph trainer does.
        "torchtitan.models.common.token_dispatcher.AllToAllTokenDispatcher": (
            "_token_count_exchange",
            "_dispatch_token_exchange",
            "_combine_token_exchange",
        ),
    }
)
"""The private hooks a subclass of each upstream class ('module.Class') may override and call."""


def subclass_hooks() -> dict[type, tuple[str, ...]]:
    """:data:`SUBCLASS_HOOKS` with each class imported from the installed torchtitan."""
    hooks = {}
    for target, names in SUBCLASS_HOOKS.items():
        module, name = target.rsplit(".", 1)
        hooks[getattr(importlib.import_module(module), name)] = names
    return hooks


# -- the CPU device ------------------------------------------------------------------------------


def _total_host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak if sys.platform == "darwin" else peak * 1024


class CpuDeviceModule:
    """The subset of ``torch.cuda``'s interface that torchtitan's Trainer calls.

    Memory figures are the host process's peak RSS, the only honest number on CPU.
    """

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        return SimpleNamespace(name="cpu", total_memory=_total_host_memory())

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        # Peak RSS cannot be reset from inside the process.
        pass

    # torchtitan's profiler records allocator history through device_module.memory (torch.cuda's
    # private recorder); the CPU has none.
    memory = SimpleNamespace(
        _record_memory_history=lambda *args, **kwargs: None,
        _snapshot=lambda: {},
    )


def _without_a_cpu_peak(get_peak_flops):
    """torchtitan's peak-FLOPs lookup, answering NaN (no peak) for the CPU device.

    torchtitan's ``get_peak_flops`` runs ``lspci`` first (absent from most containers: a warning) and then,
    knowing no CPU, returns the A100's peak with a second warning; both are printed twice per run (its
    ``MetricsProcessor`` and its ``Trainer`` each ask). The CPU has no meaningful peak: MFU is not reported.
    """

    def peak_flops(device_name: str) -> float:
        if device_name == CpuDeviceModule.get_device_name():
            return math.nan
        return get_peak_flops(device_name)

    return peak_flops


def use_cpu_device(titan_utils_module) -> None:
    """Point ``torchtitan.tools.utils``'s import-time device globals, and its peak-FLOPs lookup, at the CPU
    (right after it executes)."""
    titan_utils_module.device_type = "cpu"
    titan_utils_module.device_module = CpuDeviceModule
    titan_utils_module.get_peak_flops = _without_a_cpu_peak(titan_utils_module.get_peak_flops)


# -- torchtitan's override registry ----------------------------------------------------------------


def _override_registry() -> dict[str, Any]:
    # The module, not the decorator that torchtitan.config re-exports under the same name.
    override_module = importlib.import_module("torchtitan.config.override")
    return override_module._REGISTRY


def registered_override(target: str) -> Any | None:
    """The ``@override`` registration of factory ``target`` ('module.function'), or None."""
    return _override_registry().get(target)


def registered_override_names() -> list[str]:
    """Every registered ``@override`` factory, as 'module.function'."""
    return list(_override_registry())


def registered_overrides() -> Mapping[str, Any]:
    """torchtitan's ``@override`` registrations by 'module.function', read-only."""
    return MappingProxyType(_override_registry())


# -- models built on the meta device ----------------------------------------------------------------


def init_computed_buffers(model) -> None:
    """Fill the buffers torchtitan computes (RoPE caches) on a model whose weights come from elsewhere."""
    for module in model.modules():
        if hasattr(module, "_init_self_buffers"):
            module._init_self_buffers(buffer_device=None)


def param_initializers(module) -> Mapping[str, Any]:
    """A torchtitan module's initialiser per own parameter name (its Config's ``param_init``); empty for
    modules without one (torch's own, or a torchtitan module that initialises through ``reset_parameters``)."""
    return getattr(module, "_param_init", None) or {}


def without_checkpoint_wrapper(name: str) -> str:
    """A parameter name as it reads without torch's activation-checkpoint wrapper in it."""
    return name.replace("._checkpoint_wrapped_module", "")


def lm_head_applied_by_loss(model) -> bool:
    """Whether torchtitan's chunked loss applies ``model.lm_head`` itself (the model returns hidden states)."""
    return bool(getattr(model, "_skip_lm_head", False))


def apply_lm_head_in_loss(model) -> None:
    """Tell ``model`` that a chunked loss applies its ``lm_head`` (it returns hidden states), as torchtitan's
    Trainer does for a :class:`ChunkedLossWrapper`."""
    model._skip_lm_head = True


# -- torch's Hugging Face checkpoint reader ---------------------------------------------------------


@cache
def _aliasing_reader_class():
    import dataclasses

    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class AliasingHFStorageReader(HuggingFaceStorageReader):
        """torch's HF reader that reads some tensors from another stored tensor's bytes."""

        def __init__(self, path: str, aliases: dict[str, str], note: str | None):
            super().__init__(path)
            self.aliases = dict(aliases)
            self.note = note

        def read_metadata(self):
            metadata = super().read_metadata()
            tensors = metadata.state_dict_metadata
            for alias, stored in self.aliases.items():
                if alias in tensors or stored not in tensors:
                    continue
                tensors[alias] = tensors[stored]
                for index, info in list(metadata.storage_data.items()):
                    if index.fqn == stored:
                        metadata.storage_data[dataclasses.replace(index, fqn=alias)] = info
                logger.info(f"{self.path}: {self.note or f'{alias} is read from {stored}'}")
            return metadata

        def _process_read_request(self, f, req, planner) -> None:
            stored = self.aliases.get(req.storage_index.fqn)
            if stored is not None and req.storage_index.fqn not in f.keys():
                req = dataclasses.replace(
                    req, storage_index=dataclasses.replace(req.storage_index, fqn=stored)
                )
            super()._process_read_request(f, req, planner)

    return AliasingHFStorageReader


def hf_storage_reader_with_aliases(path: str, aliases: dict[str, str], note: str | None = None):
    """torch's ``HuggingFaceStorageReader`` for ``path`` where each ``alias`` absent from the files is read
    from the stored tensor it maps to (e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``); ``note``
    is logged when that happens."""
    return _aliasing_reader_class()(path, aliases, note)


# -- the memory estimate's tracker -----------------------------------------------------------------


def fake_tensor_mode():
    """torch's FakeTensorMode: tensors with shapes, dtypes and devices, and no storage. It takes tensors made
    outside it (a model built on the meta device, then materialised inside) as fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _per_parameter_meshes(model) -> bool:
    """Whether FSDP2 shards some module's parameters over several meshes (expert parallelism: the experts over
    their own), as several parameter groups per module, which torch's FSDP tracker does not follow."""
    from torch.distributed.fsdp import FSDPModule

    return any(
        len(getattr(module._get_fsdp_state(), "_fsdp_param_groups", None) or ()) > 1
        for module in model.modules()
        if isinstance(module, FSDPModule)
    )


def materialise_meta_tensors(model, device: str) -> None:
    """``model.to_empty(device=device)`` without swapping tensors: a model FSDP did not shard keeps the
    parameters it was built with, and torch refuses to swap one that something holds a weak reference to (the
    SPMD annotations do); each meta tensor is replaced instead, a shared one once."""
    import torch

    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in made:
                    empty = torch.empty_like(tensor, device=device)
                    is_param = isinstance(tensor, torch.nn.Parameter)
                    made[id(tensor)] = torch.nn.Parameter(empty, tensor.requires_grad) if is_param else empty
                tensors[name] = made[id(tensor)]


def step_memory_tracker(model, optimizer, inputs: tuple):
    """torch's memory tracker for training steps of ``model`` on ``inputs``: FSDP's where FSDP2 shards the model
    over one mesh per module, else the plain one (which sees the same tensors, FSDP's buffers as temporaries)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) and not _per_parameter_meshes(model):
        tracker = FSDPMemTracker(mod=model, optm=optimizer)
        tracker.track_inputs(inputs)
        return tracker
    tracker = MemTracker()
    # The plain tracker hooks the gradient of every parameter a forward meets, and torch refuses a hook on a
    # frozen one (LoRA's base weights, which get none): those are entered as hooked already, with handles that
    # have nothing to remove.
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    tracker.track_external(model, optimizer, *inputs)
    return tracker


class _NoHook:
    """A hook handle with nothing to remove (:func:`step_memory_tracker`)."""

    def remove(self) -> None:
        pass


def fake_tensor_data_dependent_errors() -> tuple[type[Exception], ...]:
    """What fake tensors raise at an op whose output shape depends on the data (``nonzero``, a boolean mask)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return (DynamicOutputShapeException, DataDependentOutputException)


def gloo_collective_copies(copies: int):
    """A dispatch mode, entered inside a memory tracker, that holds ``copies`` scratch tensors the size of each
    all-gather's output and each reduce-scatter's input while the collective runs: what gloo holds then beyond
    its buffers (measured: two copies, docs/performance.md), so that the tracker counts it."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    c10d = torch.ops.c10d
    buffer_arg = {c10d._allgather_base_.default: 0, c10d._reduce_scatter_base_.default: 1}

    class GlooCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            at = buffer_arg.get(func)
            scratch = [torch.empty_like(args[at]) for _ in range(copies)] if at is not None else []
            out = func(*args, **(kwargs or {}))
            del scratch
            return out

    return GlooCopies()


def recorded_ops():
    """A dispatch mode that appends ``(op name, its tensor outputs' shapes)`` to its ``ops`` list for every aten op
    run inside it, a read back to the host (``aten._local_scalar_dense``) included: what a graph compiler such as
    Neuron's traces, for the fixed-shape preference loss's CPU twin (``test_preference.py``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class RecordedOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes = tuple(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.ops.append((str(func), shapes))
            return out

    return RecordedOps()


def tracker_peak_by_kind(tracker) -> dict[str, int]:
    """Bytes live at the tracked peak so far, by the tracker's kind names ('Sharded Param', 'OptState', ...)."""
    return _by_kind(tracker.get_tracker_snapshot("peak"))


def tracker_current_by_kind(tracker) -> dict[str, int]:
    """Bytes live now, by the tracker's kind names."""
    return _by_kind(tracker.get_tracker_snapshot("current"))


def _by_kind(snapshot) -> dict[str, int]:
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for kind, nbytes in per_device.items():
            name = getattr(kind, "value", kind)  # the tracker's kinds are str enums; its sum is "Total"
            if name != "Total":
                out[name] = out.get(name, 0) + nbytes
    return out


# -- the CPU's fused attention kernel ----------------------------------------------------------------


def cpu_flash_attention(q_BHLD, k_BHSD, v_BHSD, *, mask_B1LS, scale: float):
    """torch's CPU flash attention under an additive mask: (output, log-sum-exp in fp32). Grouped-query when
    ``k`` and ``v`` have fewer heads than ``q``."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHLD, k_BHSD, v_BHSD, 0.0, False, attn_mask=mask_B1LS, scale=scale
    )


def cpu_flash_attention_backward(grad_BHLD, q_BHLD, k_BHSD, v_BHSD, out_BHLD, lse_BHL, *, mask_B1LS, scale):
    """The gradients of :func:`cpu_flash_attention` for ``q``, ``k`` and ``v``."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_BHLD, q_BHLD, k_BHSD, v_BHSD, out_BHLD, lse_BHL, 0.0, False, attn_mask=mask_B1LS, scale=scale
    )


# -- activation checkpointing's recomputation ---------------------------------------------------------


def in_recomputed_forward() -> bool:
    """Whether this code runs inside the autograd engine's backward: a forward that activation checkpointing
    recomputes (the engine's current graph task is -1 outside a backward)."""
    import torch

    return torch._C._current_graph_task_id() != -1


# -- the command line torchtitan's parser refuses ------------------------------------------------------

TYRO = "1.0"


@dataclass(frozen=True)
class RefusedCommandLine:
    """What tyro refused, in our terms. ``kind``: "unrecognized" (``tokens`` it did not know), "invalid_choice"
    (``value`` not among ``choices``), "invalid_value" (``message``: why the value did not convert),
    "missing_value", "fixed" (a field the command line cannot set, given ``value``), or "other" (``message``,
    tyro's own words). ``flag``: the flag as tyro spells it (``--training.mixed-precision-param``), if one;
    else, for a value a section's own checks refused, that ``section``."""

    kind: str
    flag: str | None = None
    section: str | None = None  # the config section whose construction refused the values (``checkpoint``)
    tokens: tuple[str, ...] = ()
    value: str | None = None
    choices: tuple[str, ...] = ()
    message: str = ""


def raise_on_refused_command_line(
    error_of: Callable[[RefusedCommandLine], BaseException],
) -> Callable[[], None] | None:
    """From now on in this thread, a command line tyro refuses raises ``error_of(what was refused)`` instead of
    tyro printing its box and exiting with status 2. Returns what puts the previous hook back; None when the
    installed tyro has no such hook (its box and exit stay).

    tyro 1.0's parse-error hook is private (``tyro._errors``, a ContextVar meant to be entered with its
    ``on_parse_error`` context manager around ``tyro.cli``). torchtitan's ``ConfigManager.parse_args`` calls
    ``tyro.cli`` itself, right after the config function returns, so the config function sets the variable
    for the rest of the thread's context instead (each config function sets it again).
    """
    try:
        from tyro import _errors
    except ImportError:
        return None
    hook_var = getattr(_errors, "_parse_error_hook", None)
    if hook_var is None or not _installed("tyro", "").startswith(TYRO + "."):
        return None

    def hook(event) -> None:
        raise error_of(_refused(event, _errors))

    return partial(hook_var.reset, hook_var.set(hook))


def _refused(event, errors_module) -> RefusedCommandLine:
    argument = getattr(event, "argument", None)
    flag = argument.display_name() if argument is not None else None
    if isinstance(event, errors_module.UnrecognizedArgs):
        return RefusedCommandLine("unrecognized", tokens=tuple(event.tokens))
    if isinstance(event, errors_module.InvalidChoice):
        return RefusedCommandLine("invalid_choice", flag, value=event.value, choices=tuple(event.choices))
    if isinstance(event, errors_module.InstantiationFailure):
        # A section whose __post_init__ refused its values names no argument on the event; the error tyro is
        # handling when it fires the hook names the section.
        handled = getattr(sys.exc_info()[1], "arg", None)
        section = handled if flag is None and isinstance(handled, str) else None
        return RefusedCommandLine("invalid_value", flag, section=section, message=event.message)
    if isinstance(event, errors_module.BadValue):
        kind = "missing_value" if event.reason == "too_few_values" else "fixed"
        return RefusedCommandLine(kind, flag, value=event.offending_value)
    try:
        title, contents = errors_module._render(event)
        words = " ".join(str(line).strip() for line in contents if str(line).strip())
    except Exception:  # an event tyro renders elsewhere, or a renderer that changed
        title, words = type(event).__name__, ""
    return RefusedCommandLine("other", flag, message=words or str(title))
