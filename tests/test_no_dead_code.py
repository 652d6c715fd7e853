"""No dead code: every module-level function and class under ``packages/*/src`` is named somewhere else.

A vulture-style check by name. A definition is live when its name is used anywhere in the code this
repository runs or tests: the Python files under ``packages/`` (sources and tests), ``tests/``, ``tools/``
and ``examples/`` (a name read, an attribute, an imported name, or a word inside a string that is not
a docstring or an ``__all__`` entry, so ``"module:function"`` references count), the
console scripts and entry points of every ``pyproject.toml``, and the scripts and ``.pth`` files
beside them. Comments, docstrings and the docs are not uses: a function only mentioned there is dead.

Names match as words, not per module, so a dead function sharing its name with a live one elsewhere
goes unnoticed; methods are not checked (most of ours override a torchtitan or torch hook). What a
framework calls by name and no code of ours names is in :data:`CALLED_BY_NAME`, with who calls it;
dunder names (module ``__getattr__``) are protocol hooks and ``_`` is a registration's throwaway name
(``@op.register_fake def _``): both are skipped.
"""

from __future__ import annotations

import ast
import os
import re
import tomllib
from collections import Counter
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("packages", "tests", "tools", "examples")
# Files read as words (shell scripts, Slurm scripts); .pth files are Python statements.
SCRIPT_SUFFIXES = (".sh", ".sbatch")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# name -> what calls it by name, where no code, string or entry point of ours names it. Empty today:
# torchtitan's config functions, the entry points' targets and the NKI kernels are all named somewhere.
CALLED_BY_NAME: dict[str, str] = {}


def _files(suffixes: tuple[str, ...]) -> Iterator[Path]:
    for top in SEARCHED:
        for folder, dirs, names in os.walk(ROOT / top):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for name in sorted(names):
                if name.endswith(suffixes):
                    yield Path(folder) / name


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _export_lists(tree: ast.Module) -> set[int]:
    """The string constants of ``__all__ = [...]``: an export list is not a use."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            found.update(id(c) for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return found


def _uses(tree: ast.Module) -> Iterator[str]:
    skipped = _docstrings(tree) | _export_lists(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.alias):
            yield from WORD.findall(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            yield from WORD.findall(node.value)


def _module_level(body: list[ast.stmt]) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    """Definitions at module level, including those under a module-level ``if``/``try``/``with``."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


def _entry_point_words() -> Iterator[str]:
    for pyproject in [ROOT / "pyproject.toml", *sorted(ROOT.glob("packages/*/pyproject.toml"))]:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        groups = [project.get("scripts", {}), project.get("gui-scripts", {})]
        groups += project.get("entry-points", {}).values()
        for group in groups:
            for target in group.values():
                yield from WORD.findall(target)


@cache
def scan() -> tuple[list[tuple[str, str, int]], Counter]:
    """(name, file, line) of every module-level definition under packages/*/src, and every use."""
    uses: Counter = Counter(_entry_point_words())
    definitions = []
    sources = [ROOT / "packages" / p / "src" for p in sorted(os.listdir(ROOT / "packages"))]
    for path in _files((".py", ".pth")):
        text = path.read_text()
        tree = ast.parse(text, filename=str(path))
        uses.update(_uses(tree))
        if path.suffix == ".py" and any(src in path.parents for src in sources):
            for node in _module_level(tree.body):
                definitions.append((node.name, str(path.relative_to(ROOT)), node.lineno))
    for path in _files(SCRIPT_SUFFIXES):
        uses.update(WORD.findall(path.read_text()))
    return definitions, uses


def dead(definitions: list[tuple[str, str, int]], uses: Counter) -> list[str]:
    return [
        f"{file}:{line}: {name}"
        for name, file, line in definitions
        if not uses[name]
        and name not in CALLED_BY_NAME
        and not (name.startswith("__") and name.endswith("__"))
        and name != "_"
    ]


def test_every_module_level_function_and_class_is_used():
    definitions, uses = scan()
    assert len(definitions) > 500  # the scan found the sources
    found = dead(definitions, uses)
    assert not found, (
        "defined but never used (delete it, or add it to CALLED_BY_NAME with why):\n" + "\n".join(found)
    )


def test_the_allow_list_holds_only_names_that_are_defined_and_otherwise_unused():
    definitions, uses = scan()
    defined = {name for name, _, _ in definitions}
    assert not set(CALLED_BY_NAME) - defined, "CALLED_BY_NAME names what no source defines"
    assert not {name for name in CALLED_BY_NAME if uses[name]}, "CALLED_BY_NAME names what code uses"


def test_a_new_unused_function_is_found():
    tree = ast.parse("def _unused_helper():\n    return 1\n\n\ndef used():\n    return 2\n")
    definitions = [(node.name, "new.py", node.lineno) for node in _module_level(tree.body)]
    uses = Counter(_uses(tree)) + Counter(["used"])
    assert dead(definitions, uses) == ["new.py:1: _unused_helper"]
