"""Docstrings and comments name only what exists (a docstring that names a parameter or module is code: when the
name changes, the docstring changes in the same commit). Over every note of the repo's .py files (a docstring, a
field's docstring, a run of comment lines), three rules, read from the text and the ast alone:

- paths: a repo path (`parallelisms/ac.py`, `docs/failures.md`) names a file that exists, and so does a bare module
  file name (`plans.py`);
- keywords: a backticked call with keyword arguments (`block_modes(cfg, layers=[0, 1])`) passes only keywords its
  function accepts, where its name is defined once in the repo; `model(...)` is a call of every family's model;
- dotted names: a name that starts with one of the repo's modules (`parallelisms.ac.block_modes`) names a module
  and a name defined in it.

Each rule leaves alone what it cannot read without guessing (another project's paths, placeholders, config keys
such as `data.path` that read like a module's names), and each is shown to catch a made-up stale docstring.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tests.test_structure import REPO, sources

Notes = list[tuple[int, str]]  # (first line, text) of each note of a module

# ---------------------------------------------------------------------------------------------------- the notes


# A line's string literals and its comment: the first '#' outside a string starts the comment.
_STRING_OR_COMMENT = re.compile(r"(\"\"\".*?\"\"\"|'''.*?'''|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*')|#(.*)")


def notes(text: str, nodes: list[ast.AST]) -> Iterator[tuple[int, str]]:
    """(first line, text) of every string statement of a module (the docstrings of the module, its classes and
    functions, and the fields' docstrings) and every run of comments on consecutive lines, '#' removed. `nodes`:
    every node of the module's tree."""
    lines = text.encode().splitlines()  # (the ast's columns count bytes)
    in_fstrings = {id(part) for node in nodes if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in nodes:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value
        if (
            isinstance(node, ast.Constant | ast.JoinedStr)
            and id(node) not in in_fstrings  # (whose positions, before Python 3.12, are the whole f-string's)
            and node.end_lineno != node.lineno
            and lines[node.lineno - 1][node.col_offset :].lstrip(b"rbfuRBFU")[:3] in (b'"""', b"'''")
        ):
            # A triple-quoted string's '#' is no comment: blank it out (its lines keep their numbers).
            start, end = node.lineno - 1, node.end_lineno - 1
            lines[start] = lines[start][: node.col_offset]
            lines[start + 1 : end] = [b""] * (end - start - 1)
            lines[end] = lines[end][node.end_col_offset :]
    run: list[str] = []
    first = last = 0
    for number, line in enumerate(lines, start=1):
        if b"#" not in line:
            continue
        comment = next((m[2] for m in _STRING_OR_COMMENT.finditer(line.decode()) if m[2] is not None), None)
        if comment is None:
            continue
        if run and number != last + 1:
            yield first, "\n".join(run)
            run = []
        if not run:
            first = number
        run.append(comment.lstrip("#").strip())
        last = number
    if run:
        yield first, "\n".join(run)


def _line(first: int, note: str, offset: int) -> int:
    return first + note.count("\n", 0, offset)


@dataclass(frozen=True)
class Repo:
    """What the rules look names up in: the repo's modules, their trees, and every def and class by name."""

    modules: dict[str, ast.Module]
    defs: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]]
    top_dirs: frozenset[str]  # the repo's top-level folders (not a run's outputs/): a path under another is not ours
    py_names: frozenset[str]  # the file names of its modules: what a bare `plans.py` may name


@functools.cache
def texts() -> dict[str, tuple[str, ast.Module, list[ast.AST], Notes]]:
    """Module name -> (path relative to the repo, tree, its nodes, notes), read once."""
    found = {}
    for module, path in sources():
        text = path.read_text()
        nodes = list(ast.walk(tree := ast.parse(text)))
        found[module] = (path.relative_to(REPO).as_posix(), tree, nodes, list(notes(text, nodes)))
    return found


@functools.cache
def repo() -> Repo:
    defs: dict[str, list] = {}
    for _, _, nodes, _ in texts().values():
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defs.setdefault(node.name, []).append(node)
    return Repo(
        modules={module: tree for module, (_, tree, _, _) in texts().items()},
        defs=defs,
        top_dirs=frozenset(
            p.name for p in REPO.iterdir() if p.is_dir() and p.name != "outputs" and not p.name.startswith(".")
        ),
        py_names=frozenset(path.rpartition("/")[2] for path, _, _, _ in texts().values()),
    )


# ----------------------------------------------------------------------------------------------------- paths

PATH = re.compile(r"(?<![\w./~<>*-])((?:[\w-]+/)*[\w-]+\.(?:py|md|toml))(?![\w/])")
# Projects whose own files a note names (`torchtitan docs/performance.md`): a path right after one is theirs.
FOREIGN = re.compile(r"\b(torchtitan|torch|pytorch|transformers|OLMo-core|litgpt|nanoGPT|gpt-fast|lm-eval)('s)?$")


def _foreign(before: str) -> bool:
    """Whether the text before a path on its line ends with another project's name, maybe with paths of it between."""
    while True:
        before = before.rstrip(" `'\"(),")
        stripped = re.sub(r"(?:[\w-]+/)*[\w.-]+\.\w+$", "", before)
        if stripped == before:
            return bool(FOREIGN.search(before))
        before = stripped


def path_problems(where: str, noted: Notes, found: Repo) -> list[str]:
    """A path with a slash, under one of the repo's top-level folders or the note's own folder, that does not exist
    (a path under another folder, `path/to/x.py`, is someone else's); a bare module file name that is no module's.
    Left alone: bare .md and .toml names (`config.toml` is a file a run writes), ALL-CAPS placeholders (`SCRIPT.py`)
    and another project's paths."""
    problems = []
    folder = REPO / where.rpartition("/")[0]
    for first, note in noted:
        for match in PATH.finditer(note):
            path = match.group(1)
            line_start = note.rfind("\n", 0, match.start()) + 1
            if path.partition(".")[0].isupper() or _foreign(note[line_start : match.start()]):
                continue
            if "/" in path:
                top = path.split("/")[0]
                beside = folder != REPO and (folder / top).is_dir()
                if top not in found.top_dirs and not beside:
                    continue
                if (REPO / path).exists() or (beside and (folder / path).exists()):
                    continue
            elif not path.endswith(".py") or path in found.py_names:
                continue
            problems.append(f"{where}:{_line(first, note, match.start())}: {path} does not exist")
    return problems


# -------------------------------------------------------------------------------------------------- keywords

BACKTICKED = re.compile(r"`([^`]*\w\s*\([^`]*\b\w+\s*=[^`]*)`")  # a backticked span with a call and a keyword
# A call on one of these is another library's (`torch.load(weights_only=True)`), whatever the repo defines.
FOREIGN_ROOTS = {"torch", "nn", "F", "dist", "np", "os", "json", "datasets", "transformers", "tokenizer"}


def _accepted(node: ast.AST) -> set[str] | None:
    """The keywords a def or class accepts; None where it takes any (**kwargs) or where that cannot be read here (a
    class without its own __init__ that is no plain dataclass)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        arguments = node.args
        return None if arguments.kwarg else {a.arg for a in (*arguments.args, *arguments.kwonlyargs)}
    assert isinstance(node, ast.ClassDef)
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            return _accepted(item)
    if node.bases or not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
        return None
    return {
        item.target.id
        for item in node.body
        if isinstance(item, ast.AnnAssign)
        and isinstance(item.target, ast.Name)
        and "ClassVar" not in ast.unparse(item.annotation)
    }


def _models_forward(found: Repo) -> list[ast.AST]:
    """The `forward` of every family's model (models/<family>/model.py's Transformer): what `model(...)` calls."""
    forwards = []
    for module, tree in found.modules.items():
        if re.fullmatch(r"models\.\w+\.model", module):
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name == "Transformer":
                    forwards += [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    return forwards


def keyword_problems(where: str, noted: Notes, found: Repo) -> list[str]:
    """A backticked call with a keyword its function does not take. The function is the one def or class of its
    last name in the repo (a name defined twice, or not at all, is not checked); `model(...)` is every family's
    Transformer.forward, and each must take the keyword (the skeleton models/__init__.py describes is shared)."""
    problems = []
    for first, note in noted:
        for match in BACKTICKED.finditer(note):
            try:
                expression = ast.parse(match.group(1).strip(), mode="eval")
            except SyntaxError:
                continue
            for call in ast.walk(expression):
                if not isinstance(call, ast.Call) or not any(k.arg for k in call.keywords):
                    continue
                name = ast.unparse(call.func)
                if name.split(".")[0] in FOREIGN_ROOTS:
                    continue
                targets = _models_forward(found) if name == "model" else found.defs.get(name.rpartition(".")[2], [])
                if name != "model" and len(targets) != 1:
                    continue
                for target in targets:
                    accepted = _accepted(target)
                    unknown = [k.arg for k in call.keywords if k.arg and accepted is not None and k.arg not in accepted]
                    if unknown:
                        callee = "a family's Transformer.forward" if name == "model" else f"{target.name}()"
                        problems.append(
                            f"{where}:{_line(first, note, match.start())}: `{match.group(1)}`: "
                            f"{callee} takes no {', '.join(unknown)}"
                        )
                        break
    return problems


# ---------------------------------------------------------------------------------------------- dotted names

DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
# What `name.suffix` is when it is a file (`config.json`, `metrics.jsonl`), not a module's name.
FILE_SUFFIXES = {"py", "md", "toml", "json", "jsonl", "yaml", "yml", "txt", "csv", "log", "sh", "pt", "bin", "jinja"}
# Modules named like the objects the code keeps in a variable of that name (`loss.backward()`, `config.use_cache`),
# besides those named like a config section (`data.path`, `optimizer.lr`): `module.lower_name` of these is read as
# such an object's attribute or a config key when no module defines it.
LIKE_A_VARIABLE = {"loss", "config"}


def _names(body: list[ast.stmt]) -> set[str]:
    """The names a module's or a class's body defines: defs, classes, assignments, imports (under if/try/with too)."""
    names = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.If | ast.Try | ast.With):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            names |= _names(inner)
    return names


@functools.cache
def _module_names(tree: ast.Module) -> frozenset[str]:
    return frozenset(_names(tree.body))


@functools.cache
def _config_sections() -> frozenset[str]:
    """The TOML sections: the fields of config.JobConfig."""
    for node in ast.walk(repo().modules["config.sections"]):
        if isinstance(node, ast.ClassDef) and node.name == "JobConfig":
            return frozenset(_names(node.body))
    raise AssertionError("config/sections.py defines no JobConfig")


def _members(cls: ast.ClassDef, found: Repo) -> set[str] | None:
    """The names a class and its bases define; None where a base is not the repo's own (one class of that name)."""
    members = _names(cls.body)
    for base in cls.bases:
        defined = found.defs.get(ast.unparse(base).rpartition(".")[2], [])
        if len(defined) != 1 or not isinstance(defined[0], ast.ClassDef):
            return None
        inherited = _members(defined[0], found)
        if inherited is None:
            return None
        members |= inherited
    return members


def resolves(parts: list[str], found: Repo) -> bool:
    """Whether `a.b.c` names a module of the repo and, after it, a name defined at its top level (and a name defined
    in that class or its bases, if a class's member follows and no base is another library's)."""
    cut = max(n for n in range(len(parts) + 1) if n == 0 or ".".join(parts[:n]) in found.modules)
    if cut == 0:
        return False
    rest = parts[cut:]
    if not rest:
        return True
    tree = found.modules[".".join(parts[:cut])]
    if rest[0] not in _module_names(tree):
        return False
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == rest[0]), None)
    if len(rest) == 1 or cls is None:
        return True
    members = _members(cls, found)
    return members is None or rest[1] in members


def dotted_problems(where: str, noted: Notes, found: Repo) -> list[str]:
    """A dotted name whose first part is one of the repo's top-level modules that names no module or no name defined
    in it, nor beside the note's module (`launch.Forked` in tests/ is tests/launch.py's). Left alone: a file name
    (`config.json`), and `module.lower_name` of a module named like a config section or an object (`data.path`,
    `loss.backward`) unless its second part is a module of the repo. (A name only a module beside the note's starts,
    `cp.shard` in parallelisms/, is as often a variable's attribute: left alone too.)"""
    package = where.removesuffix(".py").replace("/", ".").rpartition(".")[0]
    tops = {module for module in found.modules if "." not in module}
    ambiguous = _config_sections() | LIKE_A_VARIABLE
    problems = []
    for first, note in noted:
        for match in DOTTED.finditer(note):
            parts = match.group(1).split(".")
            if parts[0] not in tops or parts[-1] in FILE_SUFFIXES or resolves(parts, found):
                continue
            if package and resolves([*package.split("."), *parts], found):
                continue
            if parts[0] in ambiguous and ".".join(parts[:2]) not in found.modules and parts[1].islower():
                continue
            problems.append(f"{where}:{_line(first, note, match.start())}: {match.group(1)} names nothing of the repo")
    return problems


# ------------------------------------------------------------------------------------------------------- tests

RULES = (path_problems, keyword_problems, dotted_problems)


def test_notes_name_only_what_exists() -> None:
    found = repo()
    problems = [
        problem for where, _, _, noted in texts().values() for rule in RULES for problem in rule(where, noted, found)
    ]
    assert not problems, "\n".join(["fix the note, or the name it should say:", *problems])


def _check(rule: Callable[[str, Notes, Repo], list[str]], source: str) -> list[str]:
    """What `rule` finds in the notes of `source`, a made-up module in models/, against the real repo: "line: what"."""
    noted = list(notes(source, list(ast.walk(ast.parse(source)))))
    return [problem.removeprefix("models/fake.py:") for problem in rule("models/fake.py", noted, repo())]


def test_the_notes_are_the_docstrings_and_comments() -> None:
    source = (
        '"""Module."""\n'
        "x = 1  # one\n"
        "# two, three\n"
        "#   four\n"
        'y = "# not a comment"\n'
        'z = """\n# not a comment either\n"""  # five\n'
        "\n"
        "def f():\n"
        '    """F."""\n'
        "    a: int = 0\n"
        '    """A field\'s docstring."""\n'
    )
    assert sorted(notes(source, list(ast.walk(ast.parse(source))))) == [
        (1, "Module."),
        (2, "one\ntwo, three\nfour"),
        (8, "five"),
        (11, "F."),
        (13, "A field's docstring."),
    ]


def test_a_missing_path_is_caught() -> None:
    source = '"""See parallelisms/ac.py, docs/failures.md, llama3/plans.py and plans.py;\nparallelisms/nowhere.py."""'
    assert _check(path_problems, source) == ["2: parallelisms/nowhere.py does not exist"]
    assert _check(path_problems, "# nowhere.py and llama3/nowhere.py\n") == [
        "1: nowhere.py does not exist",
        "1: llama3/nowhere.py does not exist",
    ]
    # Another project's paths and placeholders are not the repo's.
    source = "# torchtitan docs/performance.md (benchmarks/x_torchtitan.md); `python path/to/SCRIPT.py`, torch/x.py\n"
    assert _check(path_problems, source) == []


def test_a_keyword_the_function_does_not_take_is_caught() -> None:
    source = '"""`block_modes(cfg, layers=[0])`, `model(tokens, head=loss)`; `checkpoint_module(block, anything=1)`."""'
    assert _check(keyword_problems, source) == []  # (checkpoint_module takes **options)
    source = '"""Where `block_modes(cfg, blocks=[0])` says,\nthe model stops at `model(tokens, skip_output=True)`."""'
    problems = _check(keyword_problems, source)
    assert problems == [
        "1: `block_modes(cfg, blocks=[0])`: block_modes() takes no blocks",
        "2: `model(tokens, skip_output=True)`: a family's Transformer.forward takes no skip_output",
    ]


def test_a_dotted_name_that_names_nothing_is_caught() -> None:
    source = (
        "# parallelisms.ac.block_modes, models.llama3.model.FeedForward, models.family.ModelFamily.tp_plan,\n"
        "# llama3.plans.tp_plan (beside models/fake.py), data.path, loss.backward(), config.json;\n"
        "# parallelisms.ac.no_such_function, parallelisms.nowhere.apply, models.family.ModelFamily.nothing\n"
    )
    assert _check(dotted_problems, source) == [
        "3: parallelisms.ac.no_such_function names nothing of the repo",
        "3: parallelisms.nowhere.apply names nothing of the repo",
        "3: models.family.ModelFamily.nothing names nothing of the repo",
    ]
