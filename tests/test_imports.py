"""The modules of pdserve import each other without a circle (checked on the source, so every
import counts: the ones inside functions that a test run may never reach, and the ones under
``if TYPE_CHECKING:`` too, since a pair of modules naming each other's types is one job split in
two files that still reach into each other)."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

PACKAGE_DIR = Path(pdserve.__file__).parent


def module_files(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted module name -> source file, for every module and package of pdserve."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported_names(tree: ast.AST, package: str) -> list[str]:
    """Every module (or module.attribute) that ``tree`` imports, absolute, type checks included."""
    names: list[str] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names += [f"{base}.{alias.name}" for alias in node.names]
        todo.extend(ast.iter_child_nodes(node))
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the pdserve modules it imports. ``from a.b import c`` names module a.b.c if there
    is one, else a.b (an attribute of it)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {owner(n) for n in _imported_names(ast.parse(path.read_text()), package)}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path [a, b, ..., a], or None when the graph is a DAG."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if cycle := visit(name):
            return cycle
    return None


def test_the_package_has_no_import_circle() -> None:
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_check_finds_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("def main():\n    from pkg.low import helper\n")
    (pkg / "low.py").write_text("from pkg import top\nhelper = 1\n")
    graph = import_graph(module_files(pkg))
    assert find_cycle(graph) == ["pkg.low", "pkg.top", "pkg.low"]
    del graph["pkg.top"]
    assert find_cycle(graph) is None


def test_the_check_finds_a_circle_through_a_type_checking_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "owner.py").write_text("from pkg.part import Part\n")
    (pkg / "part.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.owner import Owner\n"
    )
    graph = import_graph(module_files(pkg))
    assert graph["pkg.part"] == {"pkg.owner"}
    assert find_cycle(graph) == ["pkg.owner", "pkg.part", "pkg.owner"]


def test_only_the_entry_point_imports_the_top_command_module() -> None:
    graph = import_graph(module_files())
    importers = {name for name, targets in graph.items() if "pdserve.cli" in targets}
    assert importers == {"pdserve.__main__"}
