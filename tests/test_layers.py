"""The package's layers: a module imports only from its own layer or the layers below it.

CONTRIBUTING.md explains the order. The check reads every import statement (function-level
ones too) with `ast`, so it imports nothing and runs in milliseconds.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top. The package root (the public API) and __main__ sit in the CLI's layer;
# `testing` (fixture releases, the oracle) above it, since only tests and tools use it.
LAYERS = (
    "errors",
    "table_checks",
    "settings",
    "inputs",
    "outputs",
    "data",
    "format",
    "check",
    "llama",
    "conversion",
    "runtime",
    "quality",
    "server",
    "cli",
    "testing",
)


def _module(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "cli"
    assert parts[1] in LAYERS, f"{module} is in no layer: add clef_gguf/{parts[1]} to LAYERS and to CONTRIBUTING.md"
    return parts[1]


def _is_module(root: Path, dotted: str) -> bool:
    path = root / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every clef_gguf import in the file."""
    module = _module(root, path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:  # `from . import x` imports the submodule x, when there is one
                found.append((node.lineno, f"{target}.{a.name}" if _is_module(root, f"{target}.{a.name}") else target))
    return [(line, name) for line, name in found if name.split(".")[0] == "clef_gguf"]


def upward_imports(root: Path) -> list[str]:
    upward = []
    for path in sorted((root / "clef_gguf").rglob("*.py")):
        own = _layer(_module(root, path))
        for line, target in _imports(root, path):
            if LAYERS.index(_layer(target)) > LAYERS.index(own):
                upward.append(f"{path.relative_to(root)}:{line} ({own}) imports {target} ({_layer(target)})")
    return upward


def test_imports_go_only_downward() -> None:
    upward = upward_imports(ROOT)
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_every_package_and_module_is_a_layer() -> None:
    package = ROOT / "clef_gguf"
    names = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    names |= {p.stem for p in package.glob("*.py")} - {"__init__", "__main__"}
    assert names <= set(LAYERS), sorted(names - set(LAYERS))


def test_tools_import_only_the_package() -> None:
    """tools/ (tools/bench/ too) uses clef_gguf, never the test suite's files."""
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")}
    offenders = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in test_modules]
        if '"tests"' in path.read_text():
            offenders.append(f"{path.name} names the tests folder (sys.path?)")
    assert not offenders, offenders


def test_what_tools_import_from_the_package_is_there() -> None:
    """Every `from clef_gguf... import NAME` of tools/ names what its module has: a tool is run by hand, not by the
    suite, and would otherwise break unseen when the package moves a name."""
    import importlib

    missing = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("clef_gguf")):
                continue
            module = importlib.import_module(node.module)  # type: ignore[arg-type]
            for alias in node.names:
                package = hasattr(module, "__path__")  # (a submodule of a package is there once found)
                if not hasattr(module, alias.name) and not (package and importlib.util.find_spec(f"{node.module}.{alias.name}")):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}")
    assert not missing, missing


# `import x` / `from x import ...` at a line's start, in code or in a child's code held in a string.
_IMPORT_LINE = re.compile(r"^[ \t]*(?:from[ \t]+([\w.]+)[ \t]+import\b|import[ \t]+([\w., \t]+))", re.M)


def script_imports(root: Path) -> list[str]:
    """Where a script under tools/ imports another script of tools/, or puts a tools folder on sys.path: what scripts
    share lives in clef_gguf/testing, which they import."""
    paths = sorted((root / "tools").rglob("*.py"))
    scripts = {p.stem for p in paths}
    offenders = []
    for path in paths:
        text = path.read_text()
        name = path.relative_to(root)
        for m in _IMPORT_LINE.finditer(text):
            modules = [m[1]] if m[1] else [part.split()[0] for part in m[2].split(",") if part.strip()]
            line = text.count("\n", 0, m.start()) + 1
            offenders += [f"{name}:{line} imports the script {n}" for n in modules if n.split(".")[0] in scripts]
        if re.search(r"sys\.path\.(insert|append)\(", text):
            offenders.append(f"{name}: changes sys.path (a script's folder on it lets it import scripts)")
        if re.search(r"\b(run_path|spec_from_file_location)\(", text):
            offenders.append(f"{name}: loads a file as a module (runpy.run_path, importlib's spec_from_file_location)")
    return offenders


def test_scripts_import_no_other_script() -> None:
    offenders = script_imports(ROOT)
    assert not offenders, "\n".join(offenders)


def test_the_check_reports_a_script_import(tmp_path: Path) -> None:
    (tmp_path / "tools" / "bench").mkdir(parents=True)
    (tmp_path / "tools" / "shared.py").write_text("X = 1\n")
    (tmp_path / "tools" / "fine.py").write_text("import json\nfrom clef_gguf.testing import bench\n")
    (tmp_path / "tools" / "bench" / "a.py").write_text('"""a."""\n\nimport os, shared\n')
    child = 'CHILD = """\nimport sys\nsys.path.insert(0, sys.argv[1])\nfrom a import f\n"""\n'  # a child's code
    (tmp_path / "tools" / "bench" / "b.py").write_text(child)
    (tmp_path / "tools" / "c.py").write_text('import runpy\n\nrunpy.run_path("tools/shared.py")\n')
    assert script_imports(tmp_path) == [
        "tools/bench/a.py:3 imports the script shared",
        "tools/bench/b.py:4 imports the script a",
        "tools/bench/b.py: changes sys.path (a script's folder on it lets it import scripts)",
        "tools/c.py: loads a file as a module (runpy.run_path, importlib's spec_from_file_location)",
    ]


def test_the_check_reports_an_upward_import(tmp_path: Path) -> None:
    for folder in ("clef_gguf", "clef_gguf/format", "clef_gguf/runtime"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "clef_gguf/runtime/model.py").write_text("")
    (tmp_path / "clef_gguf/errors.py").write_text("")
    (tmp_path / "clef_gguf/format/fine.py").write_text("from .. import errors\n")
    (tmp_path / "clef_gguf/format/bad.py").write_text("def f():\n    from ..runtime import model\n")
    assert upward_imports(tmp_path) == ["clef_gguf/format/bad.py:2 (format) imports clef_gguf.runtime.model (runtime)"]


def test_the_plain_server_never_imports_ray():
    # Ray Serve is an optional extra (server/ray_serve.py, `serve --ray`): what `clef-gguf serve` imports must not load it.
    code = "import sys, clef_gguf.cli, clef_gguf.server, clef_gguf.runtime.ray_local\n"
    code += "print([m for m in sys.modules if m.split('.')[0] == 'ray'])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", (run.stdout, run.stderr)


def test_tests_import_nothing_from_tools() -> None:
    """tools/ are scripts; what tests share with them lives in clef_gguf/testing."""
    scripts = {p.stem for p in (ROOT / "tools").rglob("*.py")}
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        if re.search(r"sys\.path\.(insert|append)\(.*tools", text):
            offenders.append(f"{path.name}: puts tools/ on sys.path")
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in scripts]
    assert not offenders, offenders


def test_modules_and_functions_stay_short() -> None:
    """No module of the package or script of tools/ over 400 lines, no function over 60: a module per concern, a
    function per step. The page's JavaScript modules (server/ui/*.js) are held to the same 400 lines."""
    long_modules, long_functions = [], []
    for path in sorted((ROOT / "clef_gguf").rglob("*.js")):
        if len(path.read_text().splitlines()) > 400:
            long_modules.append(f"{path.relative_to(ROOT)}: {len(path.read_text().splitlines())} lines")
    for path in sorted([*(ROOT / "clef_gguf").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]):
        text = path.read_text()
        if len(text.splitlines()) > 400:
            long_modules.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}")
    assert not long_modules and not long_functions, long_modules + long_functions


def test_internals_names_every_module() -> None:
    """docs/internals.md's layout table is where a reader finds a module: a new one is named there."""
    text = (ROOT / "docs" / "internals.md").read_text()
    modules = [p for p in (ROOT / "clef_gguf").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    missing = [str(p.relative_to(ROOT)) for p in modules if f"`{p.stem}`" not in text and f"{p.name}" not in text]
    assert not missing, f"not in docs/internals.md: {missing}"


# --- what a layer may know: HTTP only in server/, each command on its own, tests on their own ---------------------
HTTP = ("fastapi", "starlette", "uvicorn")
# cli/ modules that are no command: the app, and what the commands share.
CLI_SHARED = {"__init__", "__main__", "app", "common", "errors", "options"}


def _third_party(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every absolute import in the file, function-level ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.partition(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.lineno, node.module.partition(".")[0]))
    return found


def http_imports(root: Path) -> list[str]:
    """Where a module below server/ imports server code or an HTTP framework, even lazily: the runtime raises typed
    errors (errors.py), and the server alone maps them to HTTP."""
    offenders = []
    below = LAYERS[: LAYERS.index("server")]
    for path in sorted((root / "clef_gguf").rglob("*.py")):
        if _layer(_module(root, path)) not in below:
            continue
        name = path.relative_to(root)
        offenders += [f"{name}:{line} imports {target}" for line, target in _imports(root, path) if _layer(target) == "server"]
        offenders += [f"{name}:{line} imports {top}" for line, top in _third_party(path) if top in HTTP]
    return offenders


def command_imports(root: Path) -> list[str]:
    """Where a CLI command module imports another command's module: what commands share lives in cli/common.py,
    cli/options.py or cli/errors.py."""
    cli = root / "clef_gguf" / "cli"
    commands = {p.stem for p in cli.glob("*.py")} - CLI_SHARED
    offenders = []
    for path in sorted(cli.glob("*.py")):
        if path.stem in commands:
            others = {f"clef_gguf.cli.{c}" for c in commands - {path.stem}}
            offenders += [f"cli/{path.name}:{line} imports {t}" for line, t in _imports(root, path) if t in others]
    return offenders


def imports_of_tests(root: Path) -> list[str]:
    """Where a test module (tests/test_*.py) imports another: what tests share lives in helper modules (tests/*.py not
    named test_*) or clef_gguf/testing."""
    offenders = []
    for path in sorted((root / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + ([a.name for a in node.names] if node.module in (None, "tests") else [])
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[-1].startswith("test_")]
    return offenders


def test_runtime_and_the_layers_below_know_no_http() -> None:
    offenders = http_imports(ROOT)
    assert not offenders, "\n".join(offenders)


def test_no_command_imports_another_command() -> None:
    offenders = command_imports(ROOT)
    assert not offenders, "\n".join(offenders)


def test_no_test_module_imports_another() -> None:
    offenders = imports_of_tests(ROOT)
    assert not offenders, "\n".join(offenders)


def test_the_checks_report_http_commands_and_tests(tmp_path: Path) -> None:
    for folder in ("clef_gguf", "clef_gguf/runtime", "clef_gguf/server", "clef_gguf/cli", "tests"):
        (tmp_path / folder).mkdir()
    for folder in ("clef_gguf", "clef_gguf/runtime", "clef_gguf/server", "clef_gguf/cli"):
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "clef_gguf/server/problems.py").write_text("import fastapi\n")  # the server's to import
    (tmp_path / "clef_gguf/runtime/model.py").write_text("def f():\n    from starlette.requests import Request\n")
    (tmp_path / "clef_gguf/runtime/dataset.py").write_text("from ..server import problems\n")
    (tmp_path / "clef_gguf/cli/decide.py").write_text("from .options import x\n")
    (tmp_path / "clef_gguf/cli/options.py").write_text("")
    (tmp_path / "clef_gguf/cli/quality.py").write_text("from .common import y\nfrom .decide import SOME_ERRORS\n")
    (tmp_path / "tests/helpers.py").write_text("")
    (tmp_path / "tests/test_a.py").write_text("from helpers import z\nfrom test_b import w\nimport tests.test_b\n")
    (tmp_path / "tests/test_b.py").write_text("from tests import test_a\nfrom . import test_a as again\n")
    assert http_imports(tmp_path) == [
        "clef_gguf/runtime/dataset.py:1 imports clef_gguf.server.problems",
        "clef_gguf/runtime/model.py:2 imports starlette",
    ]
    assert command_imports(tmp_path) == ["cli/quality.py:2 imports clef_gguf.cli.decide"]
    assert imports_of_tests(tmp_path) == [
        "test_a.py:2 imports test_b",
        "test_a.py:3 imports tests.test_b",
        "test_b.py:1 imports test_a",
        "test_b.py:2 imports test_a",
    ]


# --- what each part loads: docs/internals.md's claims, each checked in a fresh interpreter -------------------------
# Python run first in the child: an import of a BLOCKED module (a package or a dotted module, or any of its submodules)
# fails, as if not installed; and is recorded, so that code catching the ImportError (an optional import) fails the
# claim too (ENDED, run last).
BLOCKER = """
import importlib.abc, sys
TRIED = []
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            TRIED.append(name)
            raise ImportError(f"{name} is blocked here: this import must not need it")
sys.meta_path.insert(0, Blocked())
"""
ENDED = """
assert not TRIED, f"imported (its ImportError caught): {TRIED}"
"""
# Every `clef-gguf --help` and `clef-gguf COMMAND --help`, in the child: each exits 0 with its usage.
HELPS = """
import contextlib, io, typer.main
from clef_gguf.cli.app import app
group = typer.main.get_command(app)
for argv in [["--help"], *([name, "--help"] for name in group.commands)]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        group.main(argv, prog_name="clef-gguf")
    assert out.getvalue().startswith("Usage: clef-gguf"), (argv, out.getvalue()[:500])
"""
# A command run to its end in the child, as `clef-gguf ARGS` runs it (cli.main): it must exit 0.
COMMAND = """
import sys
from clef_gguf.cli import main
sys.argv = ["clef-gguf", *{args!r}]
try:
    main()
except SystemExit as e:
    assert e.code in (None, 0), f"clef-gguf {args} exited {{e.code}}"
"""
_CLAIM = re.compile(r"^- (.+?) imports? no (.+)$", re.M)
DEMO_REQUEST = "clef_gguf/data/demo_request.json"  # (one request, on the demo model: decide's path from the root)


def import_claims(text: str) -> list[tuple[list[str], list[str]]]:
    """(subjects, modules they do not import) of each claim line under internals.md's "What each part imports"."""
    section = text.split("## What each part imports", 1)[1].split("\n## ", 1)[0]
    quoted = re.compile(r"`([^`]+)`")
    return [(quoted.findall(subject), quoted.findall(modules)) for subject, modules in _CLAIM.findall(section)]


def _subject_code(subject: str) -> str:
    """What the child runs for a claim's subject: the CLI's helps, a command (its files in the package), every module
    of a folder, or one module."""
    if subject.startswith("clef-gguf"):
        return HELPS if subject.endswith("--help") else COMMAND.format(args=subject.split()[1:])
    if subject.endswith("/"):
        folder = ROOT / subject
        return "".join(f"import {_module(ROOT, p)}\n" for p in sorted(folder.rglob("*.py")) if p.name != "__main__.py")
    return f"import {subject}\n"


@pytest.mark.slow
def test_the_import_claims_of_internals_are_true() -> None:
    """docs/internals.md says what --help, a command, the catalog and the runtime load; each claim holds with the
    modules it names made unimportable (a child interpreter each)."""
    claims = import_claims((ROOT / "docs" / "internals.md").read_text())
    subjects = {s for subject, _ in claims for s in subject}
    commands = {"clef-gguf --version", f"clef-gguf decide {DEMO_REQUEST}", "clef-gguf validate clef_gguf/data/demo.gguf"}
    assert {"clef-gguf --help", *commands, "clef_gguf.runtime.catalog", "clef_gguf/runtime/"} <= subjects, claims
    failed = []
    for subject, blocked in claims:
        code = f"BLOCKED = {set(blocked)!r}\n{BLOCKER}" + "".join(dict.fromkeys(map(_subject_code, subject))) + ENDED
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
        if run.returncode:
            failed.append(f"{subject} without {blocked}:\n{run.stderr[-3000:]}")
    assert not failed, "\n\n".join(failed)


def test_a_blocked_import_fails_the_claim() -> None:
    """The check can fail: the runtime's model with llama_cpp blocked; decide, whose run needs llama.cpp; a module
    under a dotted name; and an import whose ImportError is caught."""
    cases = [
        ("llama_cpp", "from clef_gguf.runtime import model\n"),
        ("llama_cpp", _subject_code(f"clef-gguf decide {DEMO_REQUEST}")),
        ("clef_gguf.conversion.writer", "from clef_gguf.conversion import writer\n"),
        ("fastapi", "try:\n    import fastapi.routing\nexcept ImportError:\n    pass\n"),
    ]
    for blocked, subject_code in cases:
        code = f"BLOCKED = {{{blocked!r}}}\n{BLOCKER}{subject_code}{ENDED}"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert run.returncode != 0, (blocked, run.stdout[-1000:], run.stderr[-2000:])
        assert "is blocked here" in run.stderr or "its ImportError caught" in run.stderr, (blocked, run.stderr[-2000:])
