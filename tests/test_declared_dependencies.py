"""Each package's pyproject.toml declares what its code imports, and the packages stay layered.

A shared environment hides an undeclared dependency: the module is there because another
package (or a dependency of a dependency) brought it. These tests read the imports from the
source (ast) and the graph from uv.lock, so they fail on the change itself, in seconds;
`python -m tools.ci` proves the same at run time with one isolated environment per package.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = "common"  # the package every backend builds on; it depends on no backend

# Declared without being imported, on purpose: version pins that keep the stack compatible
# (a torch build, the Triton it was built against, the torchtitan release the code targets).
PINS = {
    "torch": "the torch release every package is built and tested against",
    "triton": "the Triton build that matches the pinned torch on Linux",
    "torchtitan": "the torchtitan release whose API the config functions target",
}
# Exceptions whose handler makes an import inside `try:` optional.
OPTIONAL_IMPORT_HANDLERS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def normalize(name: str) -> str:
    """PEP 503 name: 'huggingface_hub' and 'HuggingFace-Hub' are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def requirement_name(requirement: str) -> str:
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not found:
        raise ValueError(f"{requirement!r}: not a PEP 508 requirement")
    return normalize(found.group(1))


@dataclass(frozen=True)
class Member:
    name: str
    folder: Path
    declared: frozenset[str]  # [project].dependencies, normalized
    test_only: frozenset[str]  # the package's own [dependency-groups], normalized

    @property
    def pyproject(self) -> str:
        return shown(self.folder / "pyproject.toml")

    @property
    def modules(self) -> frozenset[str]:
        """Top-level import names this package ships from src/."""
        src = self.folder / "src"
        if not src.is_dir():
            return frozenset()
        names = {p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
        names |= {p.stem for p in src.glob("*.py")}
        return frozenset(names)


@cache
def members() -> dict[str, Member]:
    found = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        groups = data.get("dependency-groups", {})
        test_only = {requirement_name(r) for g in groups.values() for r in g if isinstance(r, str)}
        found[normalize(project["name"])] = Member(
            name=normalize(project["name"]),
            folder=pyproject.parent,
            declared=frozenset(requirement_name(r) for r in project.get("dependencies", [])),
            test_only=frozenset(test_only),
        )
    return found


@dataclass(frozen=True)
class Import:
    module: str  # top-level name, e.g. "torch" for `from torch.nn import Linear`
    where: str  # path:line


def _catches_import_errors(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in OPTIONAL_IMPORT_HANDLERS for t in types)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def required_imports(path: Path, include_optional: bool = False) -> list[Import]:
    """Absolute imports that must succeed: not inside `try: ... except ImportError`, not under TYPE_CHECKING
    (with include_optional, those guarded by `try` too)."""
    found: list[Import] = []

    def visit(node: ast.AST, optional: bool) -> None:
        if isinstance(node, ast.Try | ast.TryStar):
            guarded = optional or (
                not include_optional and any(_catches_import_errors(h) for h in node.handlers)
            )
            for child in node.body:
                visit(child, guarded)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, optional)
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, optional)
            return
        if not optional:
            where = f"{shown(path)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found.extend(Import(a.name.split(".")[0], where) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append(Import(node.module.split(".")[0], where))
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found


@cache
def distributions_of_module() -> dict[str, frozenset[str]]:
    """Import name -> distributions providing it: workspace members from their src/, the rest installed."""
    mapping = {module: frozenset(dists) for module, dists in packages_distributions().items()}
    mapping = {module: frozenset(normalize(d) for d in dists) for module, dists in mapping.items()}
    for member in members().values():
        for module in member.modules:
            mapping[module] = frozenset({member.name})
    return mapping


def undeclared_imports(member: Member, folder: str, allowed: set[str]) -> list[str]:
    """One line per import name that `allowed` does not cover, with every place it is imported."""
    places: dict[str, list[str]] = {}
    # The package's own modules, and helpers beside the tests (a conftest puts tests/ on sys.path).
    own = member.modules | {p.stem for p in (member.folder / folder).glob("*.py")}
    for path in sorted((member.folder / folder).rglob("*.py")):
        for imp in required_imports(path):
            if imp.module in sys.stdlib_module_names or imp.module in own:
                continue
            if not distributions_of_module().get(imp.module, frozenset()) & allowed:
                places.setdefault(imp.module, []).append(imp.where)
    problems = []
    for module, where in sorted(places.items()):
        dists = distributions_of_module().get(module)
        if dists is None:
            problems.append(
                f"{', '.join(where)}: imports {module}, which no installed distribution provides: declare "
                f"the distribution that provides it in {member.pyproject}, or guard the import with "
                f"`try: ... except ImportError` if it is optional"
            )
        else:
            dist = sorted(dists)[0]
            problems.append(
                f"{', '.join(where)}: imports {module} (distribution {dist}), which {member.pyproject} does "
                f'not declare: add "{dist}" to its [project].dependencies'
                + (" (or to a dependency group of the package, for tests only)" if folder == "tests" else "")
            )
    return problems


PACKAGES = sorted(members())


def test_packages_are_discovered():
    assert CORE in PACKAGES, f"packages/*/pyproject.toml: no package named {CORE!r} (found {PACKAGES})"


@pytest.mark.parametrize("name", PACKAGES)
def test_source_imports_are_declared(name):
    member = members()[name]
    problems = undeclared_imports(member, "src", set(member.declared))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", PACKAGES)
def test_test_imports_are_declared(name):
    # A package's tests run in its own environment: its dependencies, its dependency groups, pytest.
    member = members()[name]
    problems = undeclared_imports(member, "tests", set(member.declared | member.test_only))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", PACKAGES)
def test_declared_dependencies_are_imported(name):
    """Declared but never imported costs every user an install."""
    member = members()[name]
    used: set[str] = set()
    for path in (member.folder / "src").rglob("*.py"):
        for imp in required_imports(path, include_optional=True):
            used |= distributions_of_module().get(imp.module, frozenset())
    unused = sorted(member.declared - used - set(PINS))
    assert not unused, (
        f"{member.pyproject}: declares {', '.join(unused)}, which nothing under src/ imports; "
        f"drop it, or add it to PINS in tests/test_declared_dependencies.py with the reason"
    )


def test_the_check_names_an_undeclared_import(tmp_path):
    source = tmp_path / "example" / "src" / "example" / "mod.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "import os\n"
        "import torch.nn as nn\n"
        "from example import sibling\n"
        "try:\n    import torch_neuronx\nexcept ImportError:\n    pass\n"
        "if TYPE_CHECKING:\n    import transformers\n"
        "from . import relative\n"
    )
    assert [i.module for i in required_imports(source)] == ["os", "torch", "example"]
    assert "torch_neuronx" in [i.module for i in required_imports(source, include_optional=True)]
    member = Member(name="example", folder=tmp_path / "example", declared=frozenset(), test_only=frozenset())
    problems = undeclared_imports(member, "src", set())
    assert problems == [
        f"{source}:2: imports torch (distribution torch), which {tmp_path}/example/pyproject.toml "
        'does not declare: add "torch" to its [project].dependencies'
    ]
    assert undeclared_imports(member, "src", {"torch"}) == []


# The dependency graph, from the lock: what `uv sync --locked` actually installs.


def lock_member_dependencies() -> dict[str, set[str]]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    root_project = normalize(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"])
    names = {normalize(n) for n in lock["manifest"]["members"]} - {root_project}
    graph: dict[str, set[str]] = {}
    for package in lock["package"]:
        name = normalize(package["name"])
        if name not in names:
            continue
        deps = {normalize(d["name"]) for d in package.get("dependencies", [])}
        for extra in package.get("optional-dependencies", {}).values():
            deps |= {normalize(d["name"]) for d in extra}
        graph[name] = deps & names
    return graph


def test_lock_lists_every_package():
    locked = set(lock_member_dependencies())
    assert locked == set(PACKAGES), (
        f"uv.lock members {sorted(locked)} differ from packages/*/pyproject.toml {PACKAGES}: run `uv lock`"
    )


def test_common_depends_on_no_backend():
    graph = lock_member_dependencies()
    assert not graph.get(CORE), (
        f"uv.lock: {CORE} depends on {sorted(graph[CORE])}; {CORE} depends on no backend: "
        f"move the shared code into {CORE}, or the backend-specific code out of it"
    )


@pytest.mark.parametrize("name", [p for p in PACKAGES if p != CORE])
def test_backend_depends_on_no_other_backend(name):
    others = lock_member_dependencies().get(name, set()) - {CORE}
    assert not others, (
        f"uv.lock: {name} depends on {sorted(others)}; a backend depends only on {CORE}: "
        f"move what they share into {CORE}"
    )
