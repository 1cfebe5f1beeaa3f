"""README.md's commands, checked as written.

Every `clef-gguf ...` line in a shell code block of README.md (and of docs/*.md) is parsed by the
installed `clef-gguf` console entry with `--help` appended: click parses every option before it acts on
`--help`, so an unknown command, a misspelled option or an option without its value fails, and nothing
runs. Then every README command but serve (test_server runs it) and its Python blocks run as written, in a
folder where the Hub release `cloudflare/Clef-flash` is replaced by a tiny random release of the same layout,
`request.json` is the README's JSON block, an image file is a small PNG, the files a command reads that no
README command writes are made from that release, and `examples/` is the repository's.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import clef_gguf
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama.qwen35_view import write_backbone_gguf
from clef_gguf.testing import finetune
from clef_gguf.testing.release_builder import RELEASES, build_release

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
HUB_RELEASE = "cloudflare/Clef-flash"  # the README's release, replaced by a tiny local one to run
RUN = ("convert", "graft", "validate", "plan", "decide", "demo", "eval", "compare", "calibrate")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
# Linked before its author adds it: its absence alone is excused, not a wrong anchor in it.
PENDING = {ROOT / "docs" / "devices.md"}

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL = ("bash", "sh", "shell", "console", "")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = ("&&", "||", ";", "|")

# Parses each argv (a JSON list on stdin) with the installed console entry, in one process: the exit code and
# what it wrote to stderr, per argv.
PARSE = r"""
import contextlib, io, json, sys
from importlib.metadata import entry_points

(entry,) = entry_points(group="console_scripts", name="clef-gguf")
main = entry.load()
results = []
for argv in json.load(sys.stdin):
    sys.argv, err = ["clef-gguf", *argv], io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    results.append([code, err.getvalue()])
json.dump(results, sys.stdout)
"""


def code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [body for language, body in FENCE.findall(text) if language in languages]


def command_lines(text: str) -> list[list[str]]:
    """The arguments of every `clef-gguf` command in the text's shell blocks (after env assignments, in lists)."""
    found: list[list[str]] = []
    for body in code_blocks(text, SHELL):
        for line in body.replace("\\\n", " ").splitlines():
            segment: list[str] = []
            for word in [*shlex.split(line, comments=True), ";"]:
                if word not in SEPARATORS:
                    segment.append(word)
                    continue
                while segment and ENV_ASSIGNMENT.match(segment[0]):
                    segment.pop(0)
                if segment and segment[0] == "clef-gguf":
                    found.append(segment[1:])
                segment = []
    return found


def _one_line(stderr: str) -> str:
    text = re.sub(r"[\u2500-\u257f]", " ", stderr)  # rich's box drawing
    return " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.startswith(("Usage:", "Try ")))


def parse_problems(lines: list[list[str]]) -> list[str]:
    """For each command line, why the clef-gguf command does not parse it ("" when it does)."""
    argvs = []
    for args in lines:
        cut = args.index("--") if "--" in args else len(args)
        argvs.append([*args[:cut], "--help", *args[cut:]])
    run = subprocess.run(
        [sys.executable, "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    pairs = zip(lines, results, strict=True)
    return [f"clef-gguf {shlex.join(args)}: {_one_line(err)}" if code != 0 else "" for args, (code, err) in pairs]


def test_the_two_commands_are_the_ones_ci_runs():
    blocks = code_blocks(README.read_text(), SHELL)
    assert any("pip install . && clef-gguf demo" in b and "bash tools/test.sh" in b for b in blocks)
    assert "bash tools/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "tools" / "test.sh").is_file()


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 300


# Lines the check must refuse: a misspelled option, a misspelled command, an option without its value.
WRONG = "```bash\nclef-gguf decide request.json --ubatchh 64\nclef-gguf decidee request.json\nclef-gguf plan m.gguf --vram\n```\n"


@pytest.fixture(scope="module")
def parsed() -> dict[tuple[str, ...], str]:
    """The problem of each command line of the README, the docs and WRONG (parsed in one process), by line."""
    lines = [args for text in [README.read_text(), *(p.read_text() for p in DOCS), WRONG] for args in command_lines(text)]
    lines = [args for i, args in enumerate(lines) if args not in lines[:i]]
    return {tuple(args): problem for args, problem in zip(lines, parse_problems(lines), strict=True)}


@pytest.mark.slow
def test_the_check_fails_on_a_misspelled_option_or_command(parsed):
    wrong = command_lines(WRONG)
    problems = [parsed[tuple(args)] for args in wrong]
    assert all(problems), problems
    assert "--ubatchh" in problems[0] and "decidee" in problems[1] and "--vram" in problems[2], problems
    assert not parsed[("demo",)]


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_line_parses(path, parsed):
    lines = command_lines(path.read_text())
    if path == README:
        assert {args[0] for args in lines} >= {*RUN, "serve"}, "the README shows every command"
    assert not [parsed[tuple(args)] for args in lines if parsed[tuple(args)]]


def test_the_load_signature_in_the_readme_is_the_real_one():
    text = README.read_text()
    match = re.search(r"`clef_gguf\.load\((.*?)\)`", text, re.DOTALL)
    assert match, "the README spells out clef_gguf.load's parameters"
    documented = {}
    for part in match.group(1).replace("\n", " ").split(","):
        name, _, default = part.strip().partition("=")
        documented[name] = eval(default) if default else inspect.Parameter.empty  # (the README's own text)
    real = {name: p.default for name, p in inspect.signature(clef_gguf.load).parameters.items()}
    assert documented == real


def test_links_point_to_files_and_headings():
    def anchors(path: Path) -> set[str]:
        headings = re.findall(r"^#+ (.+)$", path.read_text(), re.MULTILINE)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

    problems = []
    for path in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if linked in PENDING and not linked.exists():
                continue
            if not linked.exists():
                problems.append(f"{path.name}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{path.name}: {target}: no such heading")
    assert not problems


# --- Running them ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A working folder for the README's commands, and the release that stands for the Hub's."""
    root = tmp_path_factory.mktemp("readme")
    release = build_release(tmp_path_factory.mktemp("release") / "Clef-flash", RELEASES["untied_f32"])
    [request] = code_blocks(README.read_text(), ("json",))
    (root / "request.json").write_text(json.dumps(json.loads(request)))  # (the README's request is JSON)
    # The README's clef-finetune checkpoint: a few steps of clef-finetune's own train on that release.
    checkpoint = finetune.train(release, ROOT / "examples" / "labelled.jsonl", tmp_path_factory.mktemp("run"))
    (root / "runs" / "my-clef").mkdir(parents=True)
    checkpoint.rename(root / "runs" / "my-clef" / "checkpoint-1000")
    shutil.copytree(ROOT / "examples", root / "examples")
    # What the README's graft and compare read: a community-style backbone-only file, and an f16 conversion.
    clef_gguf.convert(release, root / "clef-flash-f16.gguf", "f16")
    full = clef_gguf.convert(release, tmp_path_factory.mktemp("community") / "full.gguf", "q4_k_m")
    (root / "graft").mkdir()  # graft writes the name convert writes: its own folder
    f = GGUFFile.open(full)
    try:
        write_backbone_gguf(f, root / "graft" / "community-Q4_K_M.gguf")
    finally:
        f.close()
    return root, release


def _run(argv: list[str], cwd: Path) -> str | None:
    run = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    return None if run.returncode == 0 else f"{shlex.join(argv[2:])}: exit {run.returncode}: {run.stderr[-2000:]}"


@pytest.mark.slow
def test_the_readme_commands_run_as_written(folder):
    root, release = folder
    lines = [args for args in command_lines(README.read_text()) if args and args[0] in RUN]
    lines = [args for i, args in enumerate(lines) if args not in lines[:i]]  # (the demo is in it twice)
    lines.sort(key=lambda args: args[0] != "convert")  # the files the others read
    cli = [sys.executable, "-m", "clef_gguf.cli"]
    for args in lines:
        for word in args:
            if word.endswith(IMAGE_SUFFIXES) and not (root / word).exists():
                pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / word)
    argvs = [[*cli, *(str(release) if word == HUB_RELEASE else word for word in args)] for args in lines]
    converts = [a for a in argvs if a[3] == "convert"]
    problems = [p for p in (_run(a, root) for a in converts) if p]
    assert not problems, problems
    where = {"graft": root / "graft"}
    rest = [a for a in argvs if a not in converts]
    with ThreadPoolExecutor(2) as pool:
        problems = [p for p in pool.map(lambda a: _run(a, where.get(a[3], root)), rest) if p]
    assert not problems, problems
    assert {args[0] for args in lines} == set(RUN)


@pytest.mark.slow
def test_the_readme_python_runs_as_written(folder):
    root, release = folder
    blocks = code_blocks(README.read_text(), ("python",))
    assert blocks
    for code in blocks:
        code = code.replace(f'"{HUB_RELEASE}"', repr(str(release)))
        run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
