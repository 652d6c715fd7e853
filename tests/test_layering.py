"""The shape of the code: no import cycles, common's layers import only downwards, and private names of
torchtitan and torch are used in one version-checked place (``qwen3_titan_common/compat.py``).

Read from the source with ``ast``, over every package's ``src/``, ``examples/`` and ``tools/``; the only modules
imported are those of the base classes of a class with private methods, whose upstream ancestors say
which of those methods override torch's or torchtitan's. Imports inside functions count too: a lazy
import still ties the two modules together.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from qwen3_titan_common.compat import SUBCLASS_HOOKS, subclass_hooks

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "packages").glob("*/src")) + [ROOT / "examples"]
COMPAT = ROOT / "packages/common/src/qwen3_titan_common/compat.py"
UPSTREAM = ("torch", "torchtitan")

# common's layers, lowest first: a module may import its own layer and those below it.
LAYERS = [
    {"errors", "compat"},
    {"runtime"},
    {"arch"},
    {"perf", "assets"},
    {"models"},
    {"hf", "data"},
    {"components"},
    # What crosses the launcher/rank line: the ranks write it, the launcher reads it, so it sits below train.
    {"protocols"},
    {"train"},
    {"launcher", "scripts"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            if "assets" in path.parts and path.name != "__init__.py":
                continue
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts:
                found[".".join(parts)] = path
    # The benchmarks and CI tools, imported as ``tools.*`` from the repository root: no cycles there either.
    for path in (ROOT / "tools").rglob("*.py"):
        parts = ["tools", *path.relative_to(ROOT / "tools").with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path, module: str) -> set[str]:
    """The project modules ``module`` imports (resolved to the longest known module name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import (the project imports absolutely)"
            base = node.module or ""
            names |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    resolved = set()
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            candidate = ".".join(parts[:cut])
            if candidate in MODULES:
                resolved.add(candidate)
                break
    resolved.discard(module)
    # A package's __init__ being imported on the way to its submodule is not an edge of its own.
    return {m for m in resolved if not any(other.startswith(m + ".") for other in resolved)}


GRAPH = {module: _imports(path, module) for module, path in MODULES.items()}


def test_there_are_modules_to_check():
    assert "qwen3_titan_common.launcher.launch" in GRAPH and "qwen3_titan_nki_moe.registry" in GRAPH
    assert "qwen3_titan_common.launcher.plan" in GRAPH["qwen3_titan_common.launcher.launch"]


def test_no_import_cycles():
    cycles = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target, [*stack, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "qwen3_titan_common" or len(parts) < 2:
        return None
    # The longest dotted name listed wins (a layer may name one module of a folder).
    for length in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[1 : 1 + length])
        for rank, names in enumerate(LAYERS):
            if name in names:
                return rank
    raise AssertionError(f"{module}: not in any of common's layers (tests/test_layering.py LAYERS)")


def test_common_imports_only_downwards():
    upward = []
    for module, targets in GRAPH.items():
        rank = _layer(module)
        if rank is None:
            continue
        for target in targets:
            target_rank = _layer(target)
            if target_rank is not None and target_rank > rank:
                upward.append(f"{module} (layer {rank}) imports {target} (layer {target_rank})")
    assert not upward, "\n".join(sorted(upward))


# What the launcher may use of the ranks' layer: the bound its --check-layout verdict applies (a computation on
# an exported model, not the trainer). Everything a rank checks, the launcher has a rank check.
LAUNCHER_USES_OF_TRAIN = {"qwen3_titan_common.train.tolerance"}
_ENVIRON_WRITES = ("update", "clear", "pop", "popitem", "setdefault")


def _is_environ(node) -> bool:
    return (
        isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", "") == "os"
    )


def test_the_launcher_runs_no_rank():
    """No module under launcher/ imports the trainer or the checks its ranks run, nor writes its own process's
    environment: a rank, or a rehearsal of rank 0 (``launcher.rehearse``), runs in a process of its own."""
    launcher = {m: p for m, p in MODULES.items() if m.startswith("qwen3_titan_common.launcher.")}
    assert "qwen3_titan_common.launcher.rehearse" in launcher
    found = []
    for module, path in launcher.items():
        found += [
            f"{module} imports {target}"
            for target in GRAPH[module]
            if target.startswith("qwen3_titan_common.train") and target not in LAUNCHER_USES_OF_TRAIN
        ]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
                    found.append(f"{module}:{node.lineno} writes os.environ")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if (
                    _is_environ(node.func.value)
                    and node.func.attr in _ENVIRON_WRITES
                    or node.func.attr == "putenv"
                ):
                    found.append(f"{module}:{node.lineno} writes os.environ")
    assert not found, "\n".join(found)


def test_backends_never_import_each_other():
    backends = {"qwen3_titan_native", "qwen3_titan_hf_v5", "qwen3_titan_nki_moe"}
    crossing = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if module.split(".")[0] in backends and target.split(".")[0] in backends | {"neuron_qwen3"}
        and target.split(".")[0] != module.split(".")[0]
    ]  # fmt: skip
    common = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if module.startswith("qwen3_titan_common") and target.split(".")[0] in backends
    ]
    assert not crossing and not common, crossing + common


# -- private upstream names ------------------------------------------------------------------------


def _project_private_names() -> set[str]:
    """Every ``_name`` this project defines (functions, classes, attributes, arguments): not upstream's."""
    names = set()
    for src in [*SOURCES, ROOT / "tests", ROOT / "tools"]:
        for path in src.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
    return {n for n in names if n.startswith("_")}


OURS = _project_private_names()


PROJECT = {module.split(".")[0] for module in MODULES}


def _imported_names(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """What this module imports from torch, torchtitan or the project by ``from M import N``: the name it
    is bound to -> (M, N). Only the bases of a class with private methods are imported (:func:`_class`)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in (*UPSTREAM, *PROJECT):
            for alias in node.names:
                bound[alias.asname or alias.name] = (node.module, alias.name)
    return bound


def _class(module: str, name: str) -> type | None:
    value = getattr(importlib.import_module(module), name, None)
    return value if isinstance(value, type) else None


def _upstream_in(cls: type) -> list[type]:
    """The torch and torchtitan classes among ``cls`` and its ancestors (a project class has some too)."""
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] in UPSTREAM]


def _hooks_of(bases: list[type]) -> set[str]:
    """The private hooks a subclass of ``bases`` may override (``compat.SUBCLASS_HOOKS``)."""
    hooks = subclass_hooks()
    return {
        name for owner, names in hooks.items() if any(issubclass(b, owner) for b in bases) for name in names
    }


def private_upstream_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    imported = _imported_names(tree)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(tree):
        where = f"{shown}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UPSTREAM:
            private = [
                p for p in (node.module or "").split(".") if p.startswith("_") and not p.startswith("__")
            ]
            private += [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            found += [f"{where}: imports {node.module}.{name}" for name in private]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if node.attr not in OURS:
                found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.ClassDef):
            defined = [i.name for i in node.body if isinstance(i, ast.FunctionDef | ast.AsyncFunctionDef)]
            methods = [name for name in defined if name.startswith("_") and not name.startswith("__")]
            if not methods:
                continue
            bases = [
                _class(*imported[b.id]) for b in node.bases if isinstance(b, ast.Name) and b.id in imported
            ]
            bases = [b for b in bases if b is not None]
            upstream = [c for b in bases for c in _upstream_in(b)]
            hooks = _hooks_of(bases)
            for name in methods:
                if name not in hooks and any(hasattr(c, name) for c in upstream):
                    found.append(f"{where}: {node.name} overrides {name} of an upstream class")
    return found


def test_private_upstream_names_live_in_compat_only():
    found = []
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            if path != COMPAT:
                found += private_upstream_uses(path)
    assert not found, "private torch/torchtitan names outside compat.py:\n" + "\n".join(found)


def test_the_check_sees_private_names(tmp_path):
    # The check above must be able to fail: each form it looks for, written the way code would.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "from torchtitan.config.override import _REGISTRY\n"
        "from torch.distributed.checkpoint import HuggingFaceStorageReader\n"
        "x = torch._grouped_mm\n"
        "class Reader(HuggingFaceStorageReader):\n"
        "    def _process_read_request(self, f, req, planner):\n"
        "        pass\n"
    )
    found = private_upstream_uses(sample)
    assert any("_REGISTRY" in f for f in found)
    assert any("._grouped_mm" in f for f in found)
    assert any("overrides _process_read_request" in f for f in found)


def test_a_subclass_may_override_the_hooks_compat_lists_and_no_other_private_name(tmp_path):
    # torchtitan's own subclasses override these (compat.SUBCLASS_HOOKS); through a project class as well.
    assert "_save" in SUBCLASS_HOOKS["torchtitan.components.checkpoint.CheckpointManager"]
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from torchtitan.components.checkpoint import CheckpointManager\n"
        "from qwen3_titan_common.components.checkpoint import Qwen3CheckpointManager\n"
        "class Direct(CheckpointManager):\n"
        "    def _save(self, curr_step, last_step=False):\n"
        "        return self._should_save(curr_step, last_step) and super()._save(curr_step, last_step)\n"
        "    def _states_to_load(self, model_only):\n"
        "        return {}\n"
        "class Ours(Qwen3CheckpointManager):\n"
        "    def _load(self, step=-1):\n"
        "        return super()._load(step)\n"
        "    def _create_checkpoint_id(self, step, folder=''):\n"
        "        return ''\n"
    )
    found = private_upstream_uses(sample)
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        "Direct overrides _states_to_load of an upstream class",
        "Ours overrides _create_checkpoint_id of an upstream class",
    ]


@pytest.mark.parametrize("module", ["qwen3_titan_common.compat"])
def test_compat_is_the_only_module_allowed(module):
    assert MODULES[module] == COMPAT and private_upstream_uses(COMPAT)  # it does use them: that is its job
