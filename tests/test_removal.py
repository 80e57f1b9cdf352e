"""docs/development.md's "Removing a part" table, performed: each row on a copy of the repo, then the copy collects its tests
(importing every module they use), runs the cheap ones, trains a step and, where the row edits it, plans a dry run.

The table is read from docs/development.md, so the page and this test cannot disagree. A row names the files to delete
and, per file, the names whose code goes with them: their imports, the arguments and parameters that pass them,
the dictionary and tuple entries and the statements that use them (what a forker deletes by hand, done here on
the syntax tree; in TOML files the lines that set them).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launch import REPO, python

# What runs in each copy: the tests of the core that take seconds (a pytest -k expression), and the two commands
# every fork keeps working.
CHEAP = "test_model and not parallel"
# Plain asserts: rewriting every test module's asserts, for a pass or a fail, was most of a copy's collection.
PYTEST = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--assert=plain", "-k", CHEAP]
TRAIN = [
    "train.py", "--config", "configs/debug.toml", "--training.steps=1", "--training.seq_len=64",
    "--training.local_batch_size=2", "--validation.enable=false", "--eval.enable=false", "--metrics.log_freq=1",
]  # fmt: skip


def removal_table() -> dict[str, tuple[list[str], list[tuple[set[str], list[str]]]]]:
    """part -> (paths to delete, [(names, files or globs)]) from docs/development.md's table."""
    text = (REPO / "docs" / "development.md").read_text()
    if "## Removing a part" not in text:
        return {}
    section = text[text.index("## Removing a part") :]
    rows = {}
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("to remove", "---") or set(cells[0]) <= {"-"}:
            continue
        deleted = re.findall(r"`([^`]+)`", cells[1])
        clauses = []
        for clause in cells[2].split(";"):
            if " in " not in clause:
                continue
            names, files = clause.split(" in ", 1)
            clauses.append((set(re.findall(r"`([^`]+)`", names)), re.findall(r"`([^`]+)`", files)))
        rows[cells[0]] = (deleted, clauses)
    return rows


ROWS = removal_table()


def test_the_table_has_its_rows() -> None:
    assert set(ROWS) == {
        "the benchmarks", "the doctor", "validation", "float8", "the dry run", "context parallel", "expert parallel",
        "a mixture of experts' load balancing", "async TP", "generation", "evaluation",
        "in-loop lm-eval tasks",
        "the slow-rank report and the hang watchdog", "DPO", "distillation", "LoRA",
    }, ROWS  # fmt: skip
    for part, (deleted, clauses) in ROWS.items():
        assert deleted and all((REPO / path).exists() for path in deleted), (part, deleted)
        for names, files in clauses:
            for file in files:
                matched = sorted(REPO.glob(f"**/{file}")) if "*" in file else [REPO / file]
                assert matched and all(path.exists() for path in matched), (part, file)
                # The names are really named there (in a file it gives; by some file of a glob): the table is not stale.
                naming = [p for p in matched if any(re.search(named(n), p.read_text()) for n in names)]
                assert naming == matched or ("*" in file and naming), (part, names, file)


# ------------------------------------------------------------------ removing by name


def named(name: str) -> str:
    """The pattern of a name in the table: a word, or a TOML table "[section]" at the start of a line."""
    return rf"(?m)^{re.escape(name)}" if name.startswith("[") else rf"\b{re.escape(name)}\b"


class _Remove(ast.NodeTransformer):
    """Deletes what uses `names`: import aliases (and imports of modules whose dotted path holds a name), keyword
    arguments, parameters, dict/tuple/list entries, definitions, and the smallest statements that still name one.
    A block left empty gets `pass`."""

    def __init__(self, names: set[str]):
        self.names = names

    def _named(self, node: ast.AST) -> bool:
        for n in ast.walk(node):
            if (
                (isinstance(n, ast.Name) and n.id in self.names)
                or (isinstance(n, ast.Attribute) and n.attr in self.names)
                or (isinstance(n, ast.arg) and n.arg in self.names)
                or (isinstance(n, ast.keyword) and n.arg in self.names)
            ):
                return True
        return False

    def _module_named(self, module: str | None) -> bool:
        return bool(module) and any(part in self.names for part in module.split("."))

    def _import(self, node: ast.Import | ast.ImportFrom) -> ast.stmt | None:
        if isinstance(node, ast.ImportFrom) and self._module_named(node.module):
            return None
        node.names = [a for a in node.names if not (self._module_named(a.name) or (a.asname or a.name) in self.names)]
        return node if node.names else None

    def _arguments(self, args: ast.arguments) -> None:
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        kept = [(a, d) for a, d in zip(positional, defaults, strict=True) if a.arg not in self.names]
        args.posonlyargs = [a for a in args.posonlyargs if a.arg not in self.names]
        args.args = [a for a in args.args if a.arg not in self.names]
        args.defaults = [d for _, d in kept if d is not None]
        kwonly = [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if a.arg not in self.names]
        args.kwonlyargs, args.kw_defaults = [a for a, _ in kwonly], [d for _, d in kwonly]

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        node.keywords = [k for k in node.keywords if not (k.arg in self.names or self._named(k.value))]
        return node

    def visit_Dict(self, node: ast.Dict) -> ast.AST:
        self.generic_visit(node)
        pairs = [
            (k, v)
            for k, v in zip(node.keys, node.values, strict=True)
            if not (k and self._named(k)) and not self._named(v)
        ]
        node.keys, node.values = [k for k, _ in pairs], [v for _, v in pairs]
        return node

    def _elements(self, node: ast.Tuple | ast.List | ast.Set) -> ast.AST:
        self.generic_visit(node)
        if not isinstance(getattr(node, "ctx", ast.Load()), ast.Store):
            node.elts = [e for e in node.elts if not self._named(e)]
        return node

    visit_Tuple = visit_List = visit_Set = _elements

    def body(self, statements: list[ast.stmt]) -> list[ast.stmt]:
        kept: list[ast.stmt] = []
        for st in statements:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                if (new := self._import(st)) is not None:
                    kept.append(new)
                continue
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if st.name in self.names:
                    continue
                if not isinstance(st, ast.ClassDef):
                    self._arguments(st.args)
                st.body = self.body(st.body)
                kept.append(st)
                continue
            header = {
                ast.If: lambda s: [s.test],
                ast.While: lambda s: [s.test],
                ast.For: lambda s: [s.target, s.iter],
                ast.With: lambda s: s.items,
                ast.Try: lambda s: [],
            }.get(type(st))
            if header is not None:
                if any(self._named(self.visit(h)) for h in header(st)):
                    continue
                for field in ("body", "orelse", "finalbody"):
                    if getattr(st, field, None):
                        setattr(st, field, self.body(getattr(st, field)))
                for handler in getattr(st, "handlers", []):
                    handler.body = self.body(handler.body)
                kept.append(st)
                continue
            st = self.visit(st)
            if not self._named(st):
                kept.append(st)
        return kept or [ast.Pass()]


def remove_names(path: Path, names: set[str]) -> None:
    if path.suffix == ".toml":  # the lines that name one; a name "[section]": that table, its header to the next
        kept, dropping = [], False
        for line in path.read_text().splitlines(keepends=True):
            if line.startswith("["):
                dropping = any(line.startswith(name) for name in names if name.startswith("["))
            if not dropping and not any(name in line for name in names if not name.startswith("[")):
                kept.append(line)
        path.write_text("".join(kept))
        return
    tree = ast.parse(path.read_text())
    tree.body = _Remove(names).body(tree.body)
    path.write_text(ast.unparse(ast.fix_missing_locations(tree)) + "\n")


# ------------------------------------------------------------------ one row


def _copy(dst: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dst / name)
    return dst


def _run(copy: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return python(*args, cwd=copy, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(copy)} | (env or {}))


def perform(part: str, root: Path) -> list[str]:
    """Remove `part` from a copy of the repo under `root` and run what must still work; the failures, if any."""
    copy = _copy(root / re.sub(r"\W+", "_", part))
    deleted, clauses = ROWS[part]
    for path in deleted:
        target = copy / path
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    for names, files in clauses:
        for file in files:
            for path in sorted(copy.glob(f"**/{file}")) if "*" in file else [copy / file]:
                remove_names(path, names)
    failures = []
    checks = {
        # One pytest: it imports every test module (collection; benchmarks/ tests import make bench's modules) and
        # runs the cheap ones.
        "collect every test, run the cheap ones": PYTEST,
        "a one-step train": TRAIN,
    }
    if any("planning/dry_run.py" in files for _, files in clauses):  # the row edits the dry run: it still plans
        checks["a dry run"] = [*TRAIN[:3], "--validation.enable=false", "--comm.mode=fake_backend"]
    for what, args in checks.items():
        proc = _run(copy, *args, env={"WORLD_SIZE": "2"} if "fake_backend" in " ".join(args) else None)
        if proc.returncode != 0:
            failures.append(f"{part}: {what} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return failures


def test_every_row_of_the_removal_table_leaves_a_working_recipe(tmp_path: Path) -> None:
    """Two rows at a time (two cores); each copy runs its checks in its own processes."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for found in pool.map(lambda part: perform(part, tmp_path), ROWS) for f in found]
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize(
    ("source", "names", "expected"),
    [
        ("import a, b\nfrom c.d import e\nx = 1\n", {"b", "d"}, "import a\nx = 1"),
        (
            "def f(p, q=1, *, r=2, s=3):\n    return g(p, r=r, s=s)\n",
            {"r"},
            "def f(p, q=1, *, s=3):\n    return g(p, s=s)",
        ),
        ("d = {'a': 1, 'b': r}\nt = (1, r, 2)\n", {"r"}, "d = {'a': 1}\nt = (1, 2)"),
        ("if r is not None:\n    g(r)\nelse:\n    h()\n", {"r"}, ""),
        ("for i in x:\n    r.go()\n", {"r"}, "for i in x:\n    pass"),
    ],
)
def test_removing_by_name(source: str, names: set[str], expected: str, tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    remove_names(path, names)
    assert path.read_text().strip() == (expected or "pass")
