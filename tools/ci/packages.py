"""The workspace's packages, found afresh from ``packages/*/pyproject.toml``, and the lock's graph."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = "common"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return normalize(found.group(1)) if found else ""


@dataclass(frozen=True)
class Package:
    name: str
    folder: Path
    dependencies: tuple[str, ...]  # normalized names from [project].dependencies
    groups: tuple[str, ...]  # its own [dependency-groups]: test-only dependencies, installed too
    group_requirements: tuple[str, ...] = ()  # normalized names listed in those groups

    @property
    def rel(self) -> str:
        return self.folder.relative_to(ROOT).as_posix()

    @property
    def modules(self) -> list[str]:
        """Top-level import names shipped from src/."""
        src = self.folder / "src"
        if not src.is_dir():
            return []
        names = {p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
        names = {n for n in names if not n.endswith((".egg-info", ".dist-info"))}
        names |= {p.stem for p in src.glob("*.py")}
        return sorted(names)


def discover(root: Path = ROOT) -> dict[str, Package]:
    packages = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        name = normalize(data["project"]["name"])
        deps = tuple(requirement_name(r) for r in data["project"].get("dependencies", []))
        groups = data.get("dependency-groups", {})
        in_groups = {requirement_name(r) for g in groups.values() for r in g if isinstance(r, str)}
        packages[name] = Package(
            name=name,
            folder=pyproject.parent,
            dependencies=deps,
            groups=tuple(groups),
            group_requirements=tuple(sorted(in_groups)),
        )
    return packages


def workspace_closure(package: Package, packages: dict[str, Package]) -> list[Package]:
    """The workspace packages this one depends on, directly or not."""
    seen: dict[str, Package] = {}
    todo = [d for d in package.dependencies if d in packages]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen[name] = packages[name]
            todo += [d for d in packages[name].dependencies if d in packages]
    return sorted(seen.values(), key=lambda p: p.name)


def locked_closure(lock_path: Path, package: str) -> set[str]:
    """Every distribution uv.lock installs with ``package`` and its test groups, directly or not."""
    by_name = {normalize(p["name"]): p for p in tomllib.loads(lock_path.read_text())["package"]}
    groups = by_name.get(normalize(package), {}).get("dev-dependencies", {}).values()
    seen = {normalize(dep["name"]) for group in groups for dep in group}
    todo = [package, *seen]
    while todo:
        name = todo.pop()
        for dep in by_name.get(name, {}).get("dependencies", []):
            if normalize(dep["name"]) not in seen:
                seen.add(normalize(dep["name"]))
                todo.append(normalize(dep["name"]))
    return seen
