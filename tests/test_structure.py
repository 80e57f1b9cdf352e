"""The shape of the code a newcomer reads: no import cycle among the repo's modules (imports inside
functions count; those only type checkers see do not), and no function of the recipe longer than a
screenful or two."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE_ONLY = ("tests", "benchmarks", ".venv", "outputs")  # the longest-function rule skips these
LONGEST_FUNCTION = 100  # lines, decorators and docstring included


def sources() -> Iterator[tuple[str, Path]]:
    for path in sorted(REPO.rglob("*.py")):
        parts = path.relative_to(REPO).parts
        if parts[0] in (".venv", "outputs") or any(part.startswith(".") for part in parts):
            continue
        module = ".".join(parts)[: -len(".py")].removesuffix(".__init__")
        yield module, path


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(tree: ast.Module, module: str, known: set[str]) -> set[str]:
    """The repo's modules that `module` imports, at the top or in a function."""
    found: set[str] = set()
    skipped = {id(n) for node in ast.walk(tree) if _type_checking_only(node) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of `module`
                package = module.split(".")[: -node.level] if not module.endswith("__init__") else module.split(".")
                base = ".".join([*package, base]) if base else ".".join(package)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = dict(sources())
    known = set(modules)
    return {module: imports(ast.parse(path.read_text()), module, known) for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_the_repos_modules() -> None:
    graph = import_graph()
    assert {"train", "config", "parallelisms.parallel_dims", "dry_run"} <= set(graph)
    assert "config" in graph["train"] and "dry_run" in graph["train"]  # (function-level imports are seen)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_function_of_the_recipe_is_longer_than_about_100_lines() -> None:
    long = []
    for module, path in sources():
        if module.split(".")[0] in RECIPE_ONLY:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (lines := node.end_lineno - first + 1) > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
