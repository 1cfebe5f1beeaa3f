"""Settings llama.cpp would abort on, or that a C type would wrap, are refused before anything is loaded: one line and
exit 2 from every command, a SettingsError from load() and from a Ray config's `args`. settings.LoadOptions checks
them once, where every one of them builds its options: a context of fewer cells than sequences (llama.cpp's
GGML_ASSERT on n_outputs_max: SIGABRT), a prompt limit past int32 (n_ctx, a uint32, wrapped by ctypes), a ubatch past
what llama.cpp plans for qwen35, more threads than ggml's pool holds, and keywords of the wrong type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli

import clef_gguf
from clef_gguf.data import DEMO_MODEL, DEMO_REQUEST
from clef_gguf.errors import SettingsError
from clef_gguf.server.ray_serve import validated
from clef_gguf.settings import INT32_MAX, MAX_THREADS, MAX_UBATCH

WRAPS = 1 << 32  # n_ctx = 2^32 is 0 in llama.cpp's uint32


def _commands(tmp_path: Path) -> dict[str, list[str]]:
    data = tmp_path / "data.jsonl"
    record = json.loads(Path(DEMO_REQUEST).read_text()) | {"labels": {}}
    data.write_text(json.dumps(record) + "\n")
    demo = str(DEMO_MODEL)
    return {
        "decide": ["decide", demo, str(DEMO_REQUEST)],
        "serve": ["serve", demo],
        "plan": ["plan", demo],
        "eval": ["eval", demo, str(data)],
        "compare": ["compare", demo, demo, str(data)],
        "calibrate": ["calibrate", demo, str(data), "-o", str(tmp_path / "calibrated.gguf")],
    }


def _one_line(run, says: str) -> None:
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr and says in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.lower().startswith("error")]
    assert len(errors) == 1, run.stderr


ALL = ("decide", "serve", "plan", "eval", "compare", "calibrate")
CASES = [
    *[(c, ["--ctx", "3"], "max_prompt_tokens (3) must be at least parallel (4)") for c in ALL],  # parallel's default
    *[(c, ["--ctx", str(WRAPS)], str(INT32_MAX)) for c in ALL],
    # (eval, compare and calibrate take no --parallel: they decide with its default)
    *[(c, ["--ctx", "8", "--parallel", "16"], "max_prompt_tokens (8) must be at least parallel (16)") for c in ALL[:3]],
]


@pytest.mark.parametrize("command, flags, says", CASES)
def test_every_command_refuses_a_context_llama_cpp_cannot_hold(command, flags, says, tmp_path):
    _one_line(run_cli(*_commands(tmp_path)[command], *flags), says)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--adapter-fetches", "0"], "'--adapter-fetches': Input should be greater than or equal to 1"),
        (["--adapter-fetches", "65"], "'--adapter-fetches': Input should be less than or equal to 64"),
        (["--adapter-fetch-rate", "0"], "'--adapter-fetch-rate': Input should be greater than or equal to 1"),
        (["--adapter-refresh", "-1"], "'--adapter-refresh': Input should be greater than or equal to 0"),
    ],
)
def test_serve_refuses_fetch_caps_out_of_their_bounds(flags, says, tmp_path):
    _one_line(run_cli(*_commands(tmp_path)["serve"], *flags), says)


@pytest.mark.parametrize(
    "keywords, says",
    [
        ({"max_prompt_tokens": 3}, "at least parallel (4)"),
        ({"max_prompt_tokens": 8, "parallel": 16}, "at least parallel (16)"),
        ({"max_prompt_tokens": WRAPS}, f"between 1 and {INT32_MAX}"),
        ({"ubatch": MAX_UBATCH + 1}, f"between 1 and {MAX_UBATCH}"),
        ({"max_prompt_tokens": 64, "ubatch": 65}, "cannot exceed max_prompt_tokens"),
        ({"n_threads": MAX_THREADS + 1}, f"between 1 and {MAX_THREADS}"),
        ({"n_gpu_layers": -2}, "n_gpu_layers must be between -1"),
        ({"max_prompt_tokens": True}, "max_prompt_tokens must be int, not True"),  # (True == 1: below parallel)
        ({"max_prompt_tokens": 4096.0}, "must be int, not 4096.0"),
        ({"parallel": "4"}, "parallel must be int, not '4'"),
        ({"n_threads": 2.5}, "n_threads must be int or None"),
        ({"state_cache": "1GiB"}, "state_cache must be int"),
        ({"base_head": 1}, "base_head must be bool"),
        ({"max_adapters": 2.0}, "max_adapters must be int"),
        ({"adapter_dir": ""}, "adapter_dir is an empty path"),
        ({"mmproj": ""}, "mmproj is an empty path"),
        ({"adapters": {"tune": ""}}, "adapters maps each name"),
        ({"adapter_fetches": 0}, "adapter_fetches must be between 1 and 64, not 0"),
        ({"adapter_fetch_rate": 0}, "adapter_fetch_rate must be >= 1, not 0"),
        ({"adapter_refresh": -1.0}, "adapter_refresh must be >= 0, not -1.0"),
    ],
)
def test_load_refuses_settings_llama_cpp_would_abort_on_or_of_the_wrong_type(keywords, says):
    with pytest.raises(SettingsError) as refused:
        clef_gguf.load(DEMO_MODEL, **keywords)
    assert says in str(refused.value) and "\n" not in str(refused.value), refused.value


@pytest.mark.parametrize(
    "load, says",
    [
        ({"max_prompt_tokens": 8, "parallel": 16}, "at least parallel (16)"),
        ({"max_prompt_tokens": WRAPS}, str(INT32_MAX)),
        ({"n_threads": MAX_THREADS + 1}, str(MAX_THREADS)),
    ],
)
def test_a_ray_config_refuses_them_too(load, says):
    with pytest.raises(SettingsError) as refused:
        validated({"model": str(DEMO_MODEL), "load": load})
    assert says in str(refused.value)


@pytest.mark.parametrize(
    "args, says",
    [
        ({"load": {"max_prompt_tokens": True}}, "max_prompt_tokens must be int, not True"),
        ({"load": {"max_prompt_tokens": "2048"}}, "max_prompt_tokens must be int, not '2048'"),
        ({"load": {"max_prompt_tokens": 2048.0}}, "must be int, not 2048.0"),
        ({"load": {"state_cache": 1.0}}, "state_cache must be int"),
        ({"load": {"mmproj": ""}}, "mmproj is an empty path"),
        ({"adapter_set": {"max_adapters": True}}, "max_adapters must be int"),
        ({"adapter_set": {"base_head": 1}}, "base_head must be bool"),
        ({"adapter_set": {"adapter_fetches": 65}}, "adapter_fetches must be between 1 and 64"),
        ({"adapter_set": {"adapter_fetch_rate": "60"}}, "adapter_fetch_rate must be int, not '60'"),
        ({"adapter_set": {"adapter_refresh": -5}}, "adapter_refresh must be >= 0"),
        ({"serve": {"max_queue": "64"}}, "max_queue must be int"),
        ({"serve": {"limits": {"header_timeout": True}}}, "header_timeout must be float"),
        ({"scale": {"replicas": 2.0}}, "replicas must be int or None"),
        ({"model": ""}, "model is an empty path"),
    ],
)
def test_a_ray_config_refuses_what_pydantic_would_coerce_as_load_refuses_it(args, says):
    """A config's values as written (YAML's true, "2048", 2048.0) are held to load()'s rules, not made 1 and 2048."""
    with pytest.raises(SettingsError) as refused:
        validated({"model": str(DEMO_MODEL), **args})
    assert says in str(refused.value), refused.value


def test_a_ray_config_still_takes_paths_as_text(tmp_path):
    settings = validated({"model": str(DEMO_MODEL), "load": {"mmproj": str(tmp_path / "m.gguf")}, "adapter_set": {}})
    assert settings.load.mmproj == str(tmp_path / "m.gguf") and settings.model == str(DEMO_MODEL)


@pytest.mark.parametrize("path, says", [("", "path is an empty path"), (None, "path must be str or Path, not None")])
def test_load_refuses_a_model_path_that_names_no_file(path, says):
    with pytest.raises(SettingsError, match=says):
        clef_gguf.load(path)


@pytest.mark.parametrize("size, says", [("9999999999999TiB", "too large a size"), ("8EiB", "too large a size"),
                                        ("1.2.3G", "not a size")])
def test_a_size_past_what_a_machine_addresses_is_refused_as_too_large(size, says):
    from clef_gguf.table_checks import parse_size

    with pytest.raises(SettingsError, match=says):
        parse_size(size)
    assert parse_size("7EiB") == 7 << 60 and parse_size("1.5K") == 1536
