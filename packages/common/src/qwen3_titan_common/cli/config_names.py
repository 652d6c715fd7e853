"""Lists a torchtitan module's config functions without importing it.

The launcher validates ``--config`` before starting ranks; parsing the source keeps
that check fast (importing a config registry imports torch and torchtitan).
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ConfigFunction:
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


def list_config_functions(module: str) -> list[ConfigFunction] | None:
    """Public zero-argument functions defined in the module's config registry, or None."""
    source = _registry_source(module)
    if source is None:
        return None
    tree = ast.parse(source.read_text(), filename=str(source))
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            args = node.args
            if args.args or args.posonlyargs or args.kwonlyargs or args.vararg or args.kwarg:
                continue
            doc = ast.get_docstring(node) or ""
            found.append(ConfigFunction(node.name, doc.strip().splitlines()[0] if doc else ""))
    return found
