"""``--override.imports`` entries, resolved before torchtitan sees them.

torchtitan 0.3.0 accepts only ``module.function`` entries naming one ``@override`` factory;
the Trainium recipe passes a bare module (``--override.imports my_neuron_kernels``), the form
torchtitan accepted in June 2026 and now rejects ("must be a 'module.function' path").
:func:`expand` turns a bare module into every factory that module defines (functions
decorated in it, or re-exported by it), in definition order, so both forms work; a module
that defines none is a one-line error.

:func:`complete` then adds this backend's own kernel overrides for the model components
the list leaves unclaimed: ``--override.imports`` replaces the config function's list, and
a user who swaps in their own RoPE kernel should keep the backend's MoE and RMSNorm kernels.
An entry claims a component when its ``@override`` target is, or is a sub/superclass of,
the backend override's target.

:func:`pass_kwargs` last gives each entry whose factory declares them the run's settings
(``kernels``, ``kernel_shape``) as torchtitan's own entry kwargs, ``(target, {...})``: how
``--kernels`` reaches every kernel module's ``Config``, the user's included.

All three run in ``NkiMoETrainer.__init__`` before ``Trainer.__init__`` (which calls torchtitan's
``apply_overrides``), and each decision is logged in one line.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Mapping
from types import ModuleType

from qwen3_titan_common.compat import registered_overrides
from qwen3_titan_common.errors import UserInputError
from torchtitan.config.override import Override, OverrideImport


def _registered() -> Mapping[str, Override]:
    """torchtitan's ``@override`` registry, keyed by ``module.function``, read-only (a compat seam:
    torchtitan 0.3.0 has no public way to list the registered factories)."""
    return registered_overrides()


class OverrideImportError(UserInputError):
    """An ``--override.imports`` entry we cannot resolve; one line."""


def _target(entry: OverrideImport) -> str:
    return entry if isinstance(entry, str) else entry[0]


def _is_factory(target: str) -> bool:
    module, sep, _ = target.rpartition(".")
    if not sep:
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return target in _registered()


def _import_bare_module(target: str) -> ModuleType | None:
    """The module ``target`` names, or None when it names no importable module."""
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        # A missing module *is* the answer; a module whose own imports fail is an error.
        if err.name is not None and (target == err.name or target.startswith(err.name + ".")):
            return None
        raise OverrideImportError(f"--override.imports {target}: importing it failed: {err}") from err
    except ImportError as err:
        raise OverrideImportError(f"--override.imports {target}: importing it failed: {err}") from err


def module_factories(module: ModuleType) -> list[str]:
    """The ``module.function`` keys of the ``@override`` factories ``module`` defines or re-exports."""
    exported = {id(value) for value in vars(module).values()}
    return [
        key
        for key, registered in _registered().items()
        if registered.origin_module == module.__name__ or id(registered.factory) in exported
    ]


def expand(entries: Iterable[OverrideImport]) -> tuple[list[OverrideImport], list[str]]:
    """Expand bare-module entries; returns the new list and one log line per expansion."""
    expanded: list[OverrideImport] = []
    lines: list[str] = []
    for entry in entries:
        target = _target(entry)
        if not isinstance(entry, str) or _is_factory(target):
            expanded.append(entry)
            continue
        module = _import_bare_module(target)
        if module is None:
            expanded.append(entry)  # torchtitan reports the unresolvable name itself
            continue
        factories = module_factories(module)
        if not factories:
            raise OverrideImportError(
                f"--override.imports {target}: module '{target}' defines no @override factory "
                "(decorate a function with torchtitan.config.override, or name one as module.function)"
            )
        expanded.extend(factories)
        lines.append(f"[override] --override.imports {target} -> {', '.join(factories)}")
    # The same factory twice is an error in torchtitan; a module and one of its functions
    # listed together mean it once.
    unique: list[OverrideImport] = []
    seen: set[str] = set()
    for entry in expanded:
        if _target(entry) not in seen:
            seen.add(_target(entry))
            unique.append(entry)
    return unique, lines


def _target_cls(target: str):
    registered = _registered().get(target)
    return registered.target_cls if registered is not None else None


def complete(entries: list[OverrideImport], backend: Iterable[str]) -> tuple[list[OverrideImport], list[str]]:
    """Add each ``backend`` factory whose component no entry claims; returns the list and log lines."""
    present = {_target(e) for e in entries}
    for target in present | set(backend):
        _is_factory(target)  # imports the module, registering its factories
    claimed = {t: _target_cls(t) for t in present if _target_cls(t) is not None}
    result = list(entries)
    lines: list[str] = []
    if set(backend) <= present:
        return result, lines
    for factory in backend:
        if factory in present:
            continue
        wanted = _target_cls(factory)
        owner = next(
            (t for t, cls in claimed.items() if issubclass(cls, wanted) or issubclass(wanted, cls)),
            None,
        )
        if owner is not None:
            lines.append(f"[override] {factory} not applied: {owner} overrides {wanted.__qualname__}")
            continue
        result.append(factory)
        lines.append(
            f"[override] adding the backend's {factory}: --override.imports leaves {wanted.__qualname__} to it"
        )
    return result, lines


def pass_kwargs(entries: list[OverrideImport], values: Mapping[str, object]) -> list[OverrideImport]:
    """Each entry, with ``values`` added as kwargs for the keyword parameters its factory declares.

    Entries whose factory takes none of them stay as they are (torchtitan passes a factory
    only the kwargs it accepts). An entry that already carries one of the keys with another
    value is a one-line error: the trainer sets them for the whole run.
    """
    result: list[OverrideImport] = []
    for entry in entries:
        target = _target(entry)
        _is_factory(target)  # imports the module, registering its factories
        registered = _registered().get(target)
        if registered is None:
            result.append(entry)  # torchtitan reports the unresolvable name itself
            continue
        accepted = {
            name
            for name, p in inspect.signature(registered.factory).parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        }
        wanted = {key: value for key, value in values.items() if key in accepted}
        if not wanted:
            result.append(entry)
            continue
        given = {} if isinstance(entry, str) else entry[1]
        for key, value in wanted.items():
            if key in given and given[key] != value:
                raise OverrideImportError(
                    f"--override.imports {target}: {key}={given[key]!r} in the entry, but this run sets "
                    f"{key}={value!r} for every kernel override (the mode comes from --kernels)"
                )
        result.append((target, {**given, **wanted}))
    return result
