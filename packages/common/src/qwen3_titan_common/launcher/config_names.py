"""Lists a torchtitan module's config functions without importing it.

The launcher validates ``--config`` before starting ranks; parsing the source keeps that check fast
(importing a config registry imports torch and torchtitan)."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from qwen3_titan_common.arch.published import PUBLISHED_CONFIG_FUNCTIONS


@dataclass(frozen=True)
class ConfigListing:
    """A config function as the launcher lists it: its name and the first line of its docstring."""

    name: str
    summary: str


def _registry_source(module: str) -> Path | None:
    for candidate in (f"{module}.config_registry", module):
        try:
            spec = importlib.util.find_spec(candidate)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            return Path(spec.origin)
    return None


def _made_by_call(node: ast.stmt) -> ConfigListing | None:
    """``name = <factory>(..., doc="...")`` or ``name = <factory>.published("<name>")``: a config function
    made by a factory (train.config_functions); the latter's summary is the published table's."""
    if not (
        isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    ):
        return None
    name = node.targets[0].id
    if name.startswith("_") or not isinstance(node.value, ast.Call):
        return None
    for keyword in node.value.keywords:
        if (
            keyword.arg == "doc"
            and isinstance(keyword.value, ast.Constant)
            and isinstance(keyword.value.value, str)
        ):
            return ConfigListing(name, keyword.value.value.strip().splitlines()[0])
    first = node.value.args[0] if node.value.args else None
    if isinstance(first, ast.Constant) and first.value in PUBLISHED_CONFIG_FUNCTIONS:
        return ConfigListing(name, PUBLISHED_CONFIG_FUNCTIONS[first.value][1])
    return None


def list_config_functions(module: str) -> list[ConfigListing] | None:
    """Public zero-argument functions defined in the module's config registry (written out, or made by
    a factory call with a ``doc=``), in source order, or None."""
    source = _registry_source(module)
    if source is None:
        return None
    tree = ast.parse(source.read_text(), filename=str(source))
    found = []
    for node in tree.body:
        made = _made_by_call(node)
        if made is not None:
            found.append(made)
        elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            args = node.args
            if args.args or args.posonlyargs or args.kwonlyargs or args.vararg or args.kwarg:
                continue
            doc = ast.get_docstring(node) or ""
            found.append(ConfigListing(node.name, doc.strip().splitlines()[0] if doc else ""))
    return found
