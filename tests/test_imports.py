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


def _unit(module: str) -> str:
    """The top-level part of pdserve a module belongs to: ``pdserve.kernels.rope`` -> kernels."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


# Compute, transfer and plain types: what the serving layers are built from. None of it may import
# a serving layer back (docs/architecture.md, "Dependency direction").
LOWER = {
    "attention", "auth", "device", "envs", "file_lock", "fsm", "grammar", "identity",
    "keepalive", "kernels", "kv_sizing", "lifetime", "model",
    "model_runner", "parallel", "reasoning", "registration_msg", "runner_config",
    "runner_output", "sampler",
    "sampling_params", "sequence", "thread_tuning", "tls", "transport", "types",
}  # fmt: skip
SERVING = {
    "api", "cli", "cli_common", "config_builder", "engine", "generate", "launcher",
    "launcher_args", "llm", "metrics", "registration", "router", "server", "spec",
}  # fmt: skip
WORKER = {"api", "engine", "llm", "registration", "server", "spec"}  # never the router's code


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up: a lower part importing a serving layer, a worker part importing
    the router, ``fsm`` importing anything of ours, the HTTP layer seeing more of the engine
    than ``engine.protocol``."""
    bad = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            src, dst = _unit(name), _unit(target)
            if src == dst or dst == "pdserve":
                continue
            if (
                (src in LOWER and dst in SERVING)
                or (src in WORKER and dst == "router")
                or src == "fsm"
                or (src == "api" and dst == "engine" and target != "pdserve.engine.protocol")
            ):
                bad.append(f"{name} -> {target}")
    return bad


def test_imports_point_down_the_layers() -> None:
    graph = import_graph(module_files())
    units = {_unit(name) for name in graph} - {"pdserve", "__main__"}
    assert units <= LOWER | SERVING, f"place these in LOWER or SERVING: {units - LOWER - SERVING}"
    assert layering_violations(graph) == []


def test_the_layering_check_finds_an_import_that_points_up() -> None:
    graph = {
        "pdserve.kernels.prompt_logprobs": {"pdserve.engine.protocol", "pdserve.sequence"},
        "pdserve.server": {"pdserve.router.registration", "pdserve.registration_msg"},
        "pdserve.api.app": {"pdserve.engine.protocol", "pdserve.engine.engine"},
    }
    assert layering_violations(graph) == [
        "pdserve.api.app -> pdserve.engine.engine",
        "pdserve.kernels.prompt_logprobs -> pdserve.engine.protocol",
        "pdserve.server -> pdserve.router.registration",
    ]


def environment_reads(path: Path) -> list[int]:
    """Lines of ``path`` that read or change environment variables (``os.environ``,
    ``os.getenv``, ``os.putenv``, or those names imported from ``os``)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
            and node.attr in ("environ", "environb", "getenv", "putenv", "unsetenv")
        ) or (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(a.name in ("environ", "getenv", "putenv") for a in node.names)
        ):
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_environment_variables() -> None:
    readers = {
        name: lines
        for name, path in module_files().items()
        if name != "pdserve.envs" and (lines := environment_reads(path))
    }
    assert readers == {}


def test_the_environment_check_sees_environ_and_getenv(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import os\nfrom os import getenv\nx = os.environ.get('PATH')\nos.getpid()\n")
    assert environment_reads(path) == [2, 3]
