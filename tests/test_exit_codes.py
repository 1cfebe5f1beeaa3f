"""The exit codes of `clef-gguf`: one table (errors.ExitCode), which every command uses and the docs' tables list.

The guard reads every .py under clef_gguf/ with `ast`, importing nothing, and refuses an exit code written as a
number outside clef_gguf/errors.py: an int (or 128 + N) handed to typer.Exit, SystemExit, sys.exit, os._exit or exit;
assigned to a name holding "exit_code" or "code" (a class's `exit_code = 7`, `SOME_ERRORS = 8` is caught by its use);
returned by a function named exit_code; or the default of a parameter named code or exit_code.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

from clef_gguf.check.report import _ERRORS
from clef_gguf.errors import ClefError, ExitCode, signalled

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clef_gguf"
TABLE = "errors.py"
EXITS = {"Exit", "SystemExit", "exit", "_exit"}


def _is_code(node: ast.AST | None) -> bool:
    """An int literal, arithmetic on one (128 + signum), or a conditional with one (8 if errors else 0)."""
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.IfExp):
        return _is_code(node.body) or _is_code(node.orelse)
    return isinstance(node, ast.BinOp) and (_is_code(node.left) or _is_code(node.right))


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _named_code(target: ast.AST) -> bool:
    name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
    return "exit_code" in name.lower() or name.lower() in ("code", "exit")


def _found_in(node: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    if isinstance(node, ast.Call) and _callee(node) in EXITS:
        found += [(a.lineno, f"an argument of {_callee(node)}") for a in node.args if _is_code(a)]
    elif isinstance(node, ast.Assign | ast.AnnAssign) and _is_code(node.value):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        found += [(node.lineno, "assigned to an exit code") for t in targets if _named_code(t)]
    elif isinstance(node, ast.FunctionDef):
        if node.name == "exit_code":
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return) and _is_code(n.value)]
            found += [(r.lineno, "returned by exit_code") for r in returns]
        a = node.args
        pairs = zip(a.args[len(a.args) - len(a.defaults) :], a.defaults, strict=True)
        found += [(d.lineno, f"the default of {p.arg}") for p, d in pairs if p.arg in ("code", "exit_code") and _is_code(d)]
    return found


def exit_literals(root: Path) -> list[str]:
    """'path:line (why)' for each exit code written as a number under `root` outside errors.py."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative != TABLE:
            found |= {(relative, line, why) for node in ast.walk(ast.parse(path.read_text())) for line, why in _found_in(node)}
    return [f"{path}:{line} ({why})" for path, line, why in sorted(found)]


def test_no_exit_code_outside_the_table() -> None:
    found = exit_literals(PACKAGE)
    assert not found, "exit codes written as numbers (name an ExitCode member instead):\n" + "\n".join(found)


# Lines of the code before the table (cli/decide.py, cli/quality.py, cli/errors.py, cli/__init__.py, check/pair.py).
OLD_CODE = """
SOME_ERRORS = 8


class ReleaseError(ClefError):
    exit_code = 3


def fail(message, code: int = 2):
    raise typer.Exit(code)


def main():
    raise SystemExit(128 + 2)
    os._exit(128 + signum)
    code = 0
    raise typer.Exit(SOME_ERRORS if errors else 0)


class PairReport:
    @property
    def exit_code(self):
        return 7 if self.problems else 0
    width = 256
    sys.exit(main())
"""


def test_the_guard_finds_the_old_literal_codes(tmp_path: Path) -> None:
    (tmp_path / "old.py").write_text(OLD_CODE)
    (tmp_path / TABLE).write_text(OLD_CODE)  # the table's own numbers are its to write
    assert exit_literals(tmp_path) == [
        "old.py:6 (assigned to an exit code)",
        "old.py:9 (the default of code)",
        "old.py:14 (an argument of SystemExit)",
        "old.py:15 (an argument of _exit)",
        "old.py:16 (assigned to an exit code)",
        "old.py:17 (an argument of Exit)",
        "old.py:23 (returned by exit_code)",
    ]


def test_every_error_class_exits_with_a_code_of_the_table() -> None:
    classes, todo = [], [ClefError]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo += cls.__subclasses__()
    assert {type(c.exit_code) for c in classes} == {ExitCode}, [c.__name__ for c in classes if type(c.exit_code) is not ExitCode]
    assert signalled(15) == 143


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows of the first Markdown table after `heading`, as cells, without its header and rule."""
    lines = text[text.index(heading) :].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows[2:]]


def test_the_readme_lists_every_code_of_the_table() -> None:
    """README's "Exit codes" table holds one row per ExitCode, in order, 128+N for a signal."""
    codes = [cells[0] for cells in _table((ROOT / "README.md").read_text(), "### Exit codes")]
    assert codes == [str(c.value) if c is not ExitCode.SIGNALLED else f"{c.value}+N" for c in ExitCode]


def test_the_validation_docs_list_the_codes_of_the_verdicts() -> None:
    """docs/validation.md's table: 0 complete, then each verdict's code (check/report._ERRORS), named by it."""
    rows = _table((ROOT / "docs" / "validation.md").read_text(), "## Exit codes")
    expected = [(ExitCode.OK, "complete")] + sorted((e.exit_code, v.value.replace("_", " ")) for v, e in _ERRORS.items())
    assert [int(cells[0]) for cells in rows] == [code for code, _ in expected]
    assert all(cells[1].startswith(name) for cells, (_, name) in zip(rows, expected, strict=True)), rows
