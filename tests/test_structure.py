"""The shape of the code a newcomer reads: no import cycle among the repo's modules (imports inside
functions count, and so do those only type checkers see: a loop of type-only imports is a loop for the reader too),
no function of the recipe longer than a
screenful or two, no module longer than about 1,000 lines, no import from a lower layer to a higher one, and no family's marked copy of another's code
drifted from its source."""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE_ONLY = ("tests", "benchmarks", ".venv", "outputs")  # the longest-function rule skips these
LONGEST_FUNCTION = 100  # lines, decorators and docstring included
LONGEST_MODULE = 1000  # lines: a subject larger than that is a package of several files


def sources() -> Iterator[tuple[str, Path]]:
    for path in sorted(REPO.rglob("*.py")):
        parts = path.relative_to(REPO).parts
        if parts[0] in (".venv", "outputs") or any(part.startswith(".") for part in parts):
            continue
        module = ".".join(parts)[: -len(".py")].removesuffix(".__init__")
        yield module, path


def imports(tree: ast.Module, module: str, known: set[str]) -> set[str]:
    """The repo's modules that `module` imports: at the top, in a function or under `if TYPE_CHECKING:`."""
    found: set[str] = set()
    for node in ast.walk(tree):
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
    assert {"train", "config", "parallelisms.parallel_dims", "planning.dry_run"} <= set(graph)
    assert "config" in graph["train"] and "planning.dry_run" in graph["train"]  # (function-level imports are seen)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # A loop made of an import only type checkers see is one: planning.exchanges once named memory's Setup so.
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import X\n"
    known = {"p.a", "p.b"}
    assert imports(ast.parse(source), "p.a", known) == {"p.b"}


# The recipe's layers, lowest first: a module imports from its own layer or below, never above. (The layer of a
# package holds all its modules.) tests/, benchmarks/ and scripts/ sit above them all.
LAYERS = (
    ("errors",),
    ("models",),
    ("config",),
    ("parallelisms", "lora", "data", "loss", "optimizer", "muon", "distributed", "metrics", "profiling", "fleet"),
    ("checkpoint", "forward", "inference"),
    ("generate", "evaluation", "dpo", "distill"),
    ("planning",),
    ("train", "eval"),
)


def layer(module: str) -> int:
    top = module.split(".")[0]
    if top in RECIPE_ONLY or top == "scripts":
        return len(LAYERS)
    found = [rank for rank, names in enumerate(LAYERS) if top in names]
    assert found, f"{module}: give its top-level name a layer in tests/test_structure.py LAYERS"
    return found[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported if layer(b) > layer(a))


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    graph = import_graph()
    assert upward_imports(graph) == []
    assert "data.sources" not in graph["config"] and "train" not in graph["eval"]  # the seams of 2026-11-27
    assert upward_imports({"config": {"data.sources"}, "data.sources": {"errors"}}) == ["config -> data.sources"]


def test_no_module_of_the_recipe_is_longer_than_about_1000_lines() -> None:
    long = [
        f"{path.relative_to(REPO)} ({lines} lines)"
        for module, path in sources()
        if module.split(".")[0] not in (*RECIPE_ONLY, "scripts")
        and (lines := len(path.read_text().splitlines())) > LONGEST_MODULE
    ]
    assert long == []


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


# ------------------------------------------------------------------ copies that cannot drift

# A family copies code from another on purpose (a fork deletes any one folder of models/ and the rest still runs).
# A copy says so on the line above it, transformers' way: `# Copied from models.llama3.model.FeedForward`, optionally
# `with OLD->NEW; OLD2->NEW2` for the words it changes. Where the source file is gone (a fork deleted its folder),
# the copy is its own code from then on.
COPIED = re.compile(r"^# Copied from (models(?:\.\w+)+)\.(\w+)(?: with (.+))?$", re.M)


def _definition(tree: ast.Module, *, name: str | None = None, line: int | None = None) -> ast.AST | None:
    """The top-level def or class of `tree` named `name`, or starting (decorators included) on `line`."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if node.name == name or start == line:
                return node
    return None


def copy_problems(root: Path) -> tuple[list[str], int]:
    """(one line per marked copy under root/models that differs from its source, with the first differing line;
    how many marked copies were checked)."""
    problems, checked = [], 0
    for path in sorted((root / "models").rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        for match in COPIED.finditer(text):
            module, name, renames = match.groups()
            where = f"{path.relative_to(root)}:{text[: match.start()].count(chr(10)) + 2}"
            source = root / (module.replace(".", "/") + ".py")
            if not source.is_file():
                continue
            source_text = source.read_text()
            original = _definition(ast.parse(source_text), name=name)
            copy = _definition(tree, line=text[: match.start()].count("\n") + 2)
            if original is None or copy is None:
                problems.append(
                    f"{where}: no definition {'of ' + module + '.' + name if original is None else 'below'}"
                )
                continue
            expected = ast.get_source_segment(source_text, original, padded=True) or ""
            for pair in renames.split("; ") if renames else []:
                old, new = pair.split("->")
                expected = expected.replace(old, new)
            found = ast.get_source_segment(text, copy, padded=True) or ""
            checked += 1
            if found != expected:
                first = next(
                    (a, b)
                    for a, b in zip([*found.splitlines(), ""], [*expected.splitlines(), ""], strict=False)
                    if a != b
                )
                problems.append(f"{where}: {copy.name} differs from {module}.{name}: {first[0]!r} vs {first[1]!r}")
    return problems, checked


def test_marked_copies_match_their_sources(tmp_path: Path) -> None:
    """Every `# Copied from` in models/ matches its source, and a changed copy is caught."""
    problems, checked = copy_problems(REPO)
    assert not problems, "\n".join(
        ["change the copy to match its source, or drop its marker where it is meant to differ:", *problems]
    )
    assert checked >= 5, checked
    # The check fails on a changed copy: one line of Qwen3's SwiGLU edited in a copy of models/.
    shutil.copytree(REPO / "models", tmp_path / "models", ignore=shutil.ignore_patterns("__pycache__"))
    qwen3 = tmp_path / "models" / "qwen3" / "model.py"
    qwen3.write_text(
        qwen3.read_text().replace("self.w2(F.silu(self.w1(x)) * self.w3(x))", "self.w2(F.gelu(self.w1(x)))")
    )
    problems, _ = copy_problems(tmp_path)
    assert len(problems) == 1 and "FeedForward differs from models.llama3.model.FeedForward" in problems[0], problems
    # A deleted source (a fork removed models/llama3): its copies are their own code.
    shutil.rmtree(tmp_path / "models" / "llama3")
    assert copy_problems(tmp_path)[0] == []


def test_the_readme_and_the_developers_page_name_every_root_module_and_package() -> None:
    """A newcomer finds every part of the recipe from the README's map ("Where things are") and docs/development.md's
    layout table: each module and package at the root is named in both (`train.py`, `fleet/`)."""
    parts = sorted(
        f"{path.name}/" if path.is_dir() else path.name
        for path in REPO.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists()) and path.name not in RECIPE_ONLY
    )
    readme = (REPO / "README.md").read_text()
    readme_map = readme[readme.index("## Where things are") :]
    layout = (REPO / "docs" / "development.md").read_text()
    assert [p for p in parts if f"`{p}`" not in readme_map] == []
    assert [
        p for p in parts if f"| `{p}`" not in layout and f", `{p}`" not in layout.split("## Removing a part")[0]
    ] == []
    assert {"train.py", "fleet/", "evaluation/"} <= set(parts)


def test_train_py_reads_in_screenfuls() -> None:
    """train.py is read top to bottom: none of its functions is longer than 80 lines (the rest of the recipe: 100)."""
    tree = ast.parse((REPO / "train.py").read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert long == []
