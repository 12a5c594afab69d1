"""What importing a module loads: a general node and a trainer load no solver or heavy extra.

A node only reads policies and allots chunks to roots; the planners that make policies need HiGHS,
scipy, networkx and numba, which take long to load and have no business in every node process. The
check runs in a fresh interpreter, since this test process has long imported them all.
"""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import netstorm.planning

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("highspy", "scipy", "networkx", "numba", "torch", "matplotlib")

LIGHT_MODULES = (
    "node.service",
    "node.chunks",
    "node.peers",
    "node.trainer_endpoint",
    "node.control_client",
    "netstorm",
    "netstorm.client",
    "netstorm.aclient",
    "netstorm.policy",
    "netstorm.planning",
    "netstorm.allot",
    "netstorm.planning.lanmodel",
    "netstorm.lanreport",
    "netstorm.registry",
    "netstorm.topologies",
    "netstorm.dcplanners",
    "netstorm.compression.methods",
    "netstorm.config",
)

PLANNING_MODULES = ("auxpath", "baselines", "fapt", "limit", "offload", "packing", "plan", "predict",
                    "rategraph", "rootpacking", "lanmodel", "lanwire", "aleph", "pahina", "eina", "milp", "dcplan",
                    "dcreport")


def heavy_modules_loaded_by(module: str) -> list[str]:
    """The heavy top-level packages in ``sys.modules`` after a fresh interpreter imports ``module``."""
    code = (f"import importlib, json, sys; importlib.import_module({module!r}); "
            f"print(json.dumps(sorted({{name.partition('.')[0] for name in sys.modules}} & set({list(HEAVY)!r}))))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded: list[str] = json.loads(run.stdout)
    return loaded


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_importing_a_node_or_trainer_module_loads_no_solver(module: str) -> None:
    assert heavy_modules_loaded_by(module) == []


def test_the_check_sees_a_solver_when_one_is_loaded() -> None:
    assert "highspy" in heavy_modules_loaded_by("netstorm.planning.plan")


def test_the_planning_package_holds_every_planner_and_each_imports() -> None:
    found = {info.name for info in pkgutil.iter_modules(netstorm.planning.__path__)}
    assert found == set(PLANNING_MODULES)
    for name in PLANNING_MODULES:
        importlib.import_module(f"netstorm.planning.{name}")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _library_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in (ROOT / "netstorm").rglob("*.py")}


def _imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every library module ``path`` names in an import, at the top, inside a function or for type
    checking alike (a cycle through a type-only import is still two modules that know each other)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found & known - {name}


def _cycle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A chain of imports from ``start`` back to itself, or None."""
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    seen: set[str] = set()
    while stack:
        node, chain = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*chain, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*chain, nxt]))
    return None


def test_a_cycle_is_found_through_a_module_on_it_and_not_through_one_beside_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_through("a", graph) == ["a", "b", "c", "a"]
    assert _cycle_through("d", graph) is None


def test_no_planning_module_or_the_policy_is_on_an_import_cycle() -> None:
    modules = _library_modules()
    graph = {name: _imports_of(name, path, set(modules)) for name, path in modules.items()}
    watched = [name for name in modules if name == "netstorm.policy" or name.startswith("netstorm.planning")]
    assert len(watched) == len(PLANNING_MODULES) + 2  # the planners, the package and the policy
    assert {name: _cycle_through(name, graph) for name in watched} == dict.fromkeys(watched)


def test_the_policy_imports_no_planner() -> None:
    modules = _library_modules()
    imported = _imports_of("netstorm.policy", modules["netstorm.policy"], set(modules))
    assert not {name for name in imported if name.startswith("netstorm.planning")}
    assert "netstorm.planning.predict" in _imports_of(  # the graph does see imports into the package
        "netstorm.planning.plan", modules["netstorm.planning.plan"], set(modules))
