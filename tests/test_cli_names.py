"""One meaning per name in the CLI, and help texts printed as written (in process: typer's CliRunner, cli_helpers).

`--adapter` names an adapter FILE in every command that takes one (serve's NAME=FILE names it too); convert's flag that
writes one is `--to-adapter`, its old spelling `--adapter` kept hidden for one release with a line on stderr."""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer.main
from cli_helpers import run_cli

from clef_gguf.cli.app import app

COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]


def _options(flag: str) -> list[tuple[str, Any]]:
    return [(name, p) for name, c in COMMANDS.items() for p in c.params if p.param_type_name == "option" and flag in p.opts]


def test_adapter_names_a_file_in_every_command() -> None:
    shown = {name: p.metavar for name, p in _options("--adapter") if not p.hidden}
    assert shown == {
        "decide": "FILE",
        "plan": "FILE",
        "validate": "FILE",
        "serve": "NAME=FILE",
        "eval": "FILE",
        "calibrate": "FILE",
    }
    assert [(name, p.is_flag, p.hidden) for name, p in _options("--adapter") if p.hidden] == [("convert", True, True)]
    assert [name for name, _ in _options("--to-adapter")] == ["convert"]


def test_convert_to_adapter_and_its_old_spelling(tmp_path) -> None:
    """--to-adapter is the flag; the old --adapter still works, saying so on stderr first (both: no --base, exit 2)."""
    out = tmp_path / "x.adapter.gguf"
    new = run_cli("convert", tmp_path / "checkpoint", "--to-adapter", "-o", out)
    assert new.returncode == 2 and new.stderr.strip().splitlines() == [
        "error: --to-adapter converts a clef-finetune checkpoint over its base: give the release it was trained from "
        "with --base"
    ]
    old = run_cli("convert", tmp_path / "checkpoint", "--adapter", "-o", out)
    warning, error = old.stderr.strip().splitlines()
    assert old.returncode == 2 and error == new.stderr.strip()
    assert warning.startswith("warning: convert --adapter is now --to-adapter")
    assert not out.exists()
    shown = run_cli("convert", "--help").stdout
    assert "--to-adapter" in shown and not re.search(r"--adapter\b", shown)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_texts_print_as_written(command: str) -> None:
    """Every bracketed word of an option's help is in --help as written: Rich's markup ate `[ray]` of
    pip install 'clef-gguf[ray]' (serve --help said pip install 'clef-gguf')."""
    shown = " ".join(run_cli(command, "--help").stdout.split())  # (click wraps lines)
    bracketed = {m for p in COMMANDS[command].params for m in re.findall(r"\S*\[[^\]]*\]\S*", getattr(p, "help", None) or "")}
    assert all(" ".join(b.split()) in shown for b in bracketed), sorted(b for b in bracketed if b not in shown)
    if command == "serve":
        assert "pip install 'clef-gguf[ray]'" in shown


LOAD_FLAGS = ("--n-gpu-layers", "--max-prompt-tokens", "--ubatch", "--parallel", "--threads", "--state-cache", "--mmproj")


def test_every_command_that_loads_a_model_has_the_same_model_flags() -> None:
    """decide, serve, eval, compare and calibrate read their model's flags through one group (cli/options.LoadFlags):
    the same flags, spellings, help and bounds in each (plan plans a load with its own defaults: -ngl -1)."""
    loading = ("decide", "serve", "eval", "compare", "calibrate")
    for flag in LOAD_FLAGS:
        found = {name: p for name, p in _options(flag) if name in loading}
        assert set(found) == set(loading), (flag, sorted(found))
        shapes = {(tuple(p.opts), p.help, repr(getattr(p, "min", None)), repr(getattr(p, "max", None))) for p in found.values()}
        assert len(shapes) == 1, (flag, shapes)


def test_no_command_builds_load_options_by_position_or_hands_on_keyword_dicts() -> None:
    """The flag groups make the ModelSpec (cli/options.py); the quality functions take it, never `**load`."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "clef_gguf"
    for path in [*(root / "cli").glob("*.py"), *(root / "quality").glob("*.py")]:
        text = path.read_text()
        assert "**load" not in text, path
        if path.name != "options.py":
            assert not re.search(r"LoadOptions\((?!n_gpu_layers=)[a-z]", text), path  # (demo's keywords only)
