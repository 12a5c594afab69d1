"""The layers, read from the source: the library imports no service, services import no top layer, and
neither packages nor modules import each other in a circle.

``netstorm/`` is the library everything builds on; ``node/``, ``scheduler/`` and ``bpf/`` are services
built on it; the top layer (CLI commands, emulation, benchmarks, trainers, ``netstorm local``) is the
only code that starts services. Every import counts, wherever it stands in a file (a function-level
import is loaded as surely as one at the top, only later); imports under ``if TYPE_CHECKING:`` are
never executed, so they do not count for cycles, but a library module must not name a service even
there.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("netstorm", "node", "scheduler", "bpf")
SERVICES = frozenset({"node", "scheduler", "bpf"})
TOP_LAYER = ("netstorm.commands", "netstorm.emulation", "netstorm.bench", "netstorm.trainers", "netstorm.local",
             "netstorm.cli")
TOP = "top layer"
LIBRARY = "netstorm library"


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    typing_only: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the four packages by dotted name."""
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, typing_only: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, typing_only
    if isinstance(node, ast.If) and _type_checking(node.test):
        for statement in node.body:
            yield from _walk(statement, True)
        for statement in node.orelse:
            yield from _walk(statement, typing_only)
        return
    for child in ast.iter_child_nodes(node):
        yield from _walk(child, typing_only)


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


@cache
def imports() -> tuple[Import, ...]:
    """Every import of a project module by a project module, resolved to the most specific module named
    (``from netstorm import config`` is an import of ``netstorm.config``)."""
    known = modules()
    out = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, typing_only in _walk(tree, False):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in known else base)
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    out.append(Import(name, target, node.lineno, typing_only))
    return tuple(out)


def layer(module: str) -> str:
    if any(module == top or module.startswith(top + ".") for top in TOP_LAYER):
        return TOP
    package = module.split(".")[0]
    return LIBRARY if package == "netstorm" else package


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_scan_sees_every_package_and_function_level_imports() -> None:
    names = modules()
    assert {n.split(".")[0] for n in names} == set(PACKAGES)
    assert {layer(n) for n in names} == {LIBRARY, TOP, *SERVICES}
    pairs = {(i.importer, i.imported) for i in imports()}
    assert ("netstorm.commands.node", "node.service") in pairs  # imported inside a function
    assert ("node.service", "node.core") in pairs


def test_the_library_imports_no_service_anywhere() -> None:
    wrong = [f"{names_file(i.importer)}:{i.line} imports {i.imported}" for i in imports()
             if layer(i.importer) == LIBRARY and layer(i.imported) in SERVICES]
    assert not wrong, "the library must not import node/, scheduler/ or bpf/:\n" + "\n".join(wrong)


def test_services_build_on_the_library_not_on_each_other() -> None:
    wrong = [f"{names_file(i.importer)}:{i.line} imports {i.imported}" for i in imports()
             if layer(i.importer) in SERVICES and layer(i.imported) in SERVICES - {layer(i.importer)}]
    assert not wrong, "node/, scheduler/ and bpf/ meet only through the library and the top layer:\n" + "\n".join(wrong)


def test_only_the_top_layer_imports_the_top_layer() -> None:
    wrong = [f"{names_file(i.importer)}:{i.line} imports {i.imported}" for i in imports()
             if layer(i.importer) != TOP and layer(i.imported) == TOP]
    assert not wrong, "the library and the services build on nothing above them:\n" + "\n".join(wrong)


PLANNERS = "netstorm.planning"
PLANNING_USERS = (PLANNERS, "scheduler")
"""Who may import the planners: the planning package itself, the scheduler that plans, and the top layer."""


def test_only_the_scheduler_and_the_top_layer_import_the_planners() -> None:
    """A node, the LAN tier and the rest of the library read planners' names from the registries below
    planning (``netstorm.topologies``, ``netstorm.dcplanners``) and allot chunks with ``netstorm.allot``;
    they never import ``netstorm.planning`` (its modules load solvers), not even for type checking."""
    wrong = [f"{names_file(i.importer)}:{i.line} imports {i.imported}" for i in imports()
             if (i.imported == PLANNERS or i.imported.startswith(PLANNERS + "."))
             and layer(i.importer) != TOP
             and not any(i.importer == u or i.importer.startswith(u + ".") for u in PLANNING_USERS)]
    assert not wrong, "only scheduler/ and the top layer import netstorm.planning:\n" + "\n".join(wrong)


def test_no_cycle_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for i in imports():
        a, b = layer(i.importer), layer(i.imported)
        if TOP not in (a, b) and a != b:
            graph.setdefault(a, set()).add(b)
    assert not cycles(graph), graph


def test_no_import_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for i in imports():
        if not i.typing_only:
            graph.setdefault(i.importer, set()).add(i.imported)
    found = cycles(graph)
    described = []
    for component in found:
        members = set(component)
        edges = sorted(f"{i.importer} -> {i.imported} ({names_file(i.importer)}:{i.line})" for i in imports()
                       if not i.typing_only and i.importer in members and i.imported in members)
        described.append("\n  ".join([" <-> ".join(component), *edges]))
    assert not found, "import cycles:\n" + "\n".join(described)


def test_cycles_are_found_through_function_level_imports() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def names_file(module: str) -> str:
    return str(modules()[module].relative_to(ROOT))
