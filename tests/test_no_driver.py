"""A llama-cpp-python whose libraries cannot load here (a CUDA build on a machine without NVIDIA's driver)
is one clear error, never the dynamic loader's traceback: `import clef_gguf` works, and the first use, the CLI
included, says what is wrong and what to do.

Here a stand-in llama_cpp package first on the path raises the loader's own error, and holds a libggml-cuda.so as a
CUDA build does. tools/cuda_check_here.sh runs the same checks on the real CUDA wheel (tools/cuda_build.sh), where
.ci/run finds it built.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LOADER = "libcuda.so.1: cannot open shared object file: No such file or directory"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "llama_cpp"
    (package / "lib").mkdir(parents=True)
    (package / "lib" / "libggml-cuda.so").write_bytes(b"")
    (package / "__init__.py").write_text(f"raise OSError({LOADER!r})\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_works_and_the_first_use_says_why(env):
    assert _python("import clef_gguf; print(clef_gguf.__version__)", env).returncode == 0
    done = _python(
        "import clef_gguf\ntry:\n    clef_gguf.load('m.gguf')\nexcept clef_gguf.BackendUnavailableError as e:\n    print(e)", env
    )
    assert done.returncode == 0, done.stderr
    assert LOADER in done.stdout and "CUDA build" in done.stdout and "no NVIDIA driver" in done.stdout
    assert "pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36" in done.stdout


@pytest.mark.parametrize("args", [["demo"], ["demo", "-ngl", "-1"], ["plan", "model.gguf"]])
def test_the_cli_is_one_line_and_exit_1(env, args):
    done = subprocess.run([sys.executable, "-m", "clef_gguf.cli", *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("error: llama-cpp-python's libraries cannot load (libcuda.so.1")
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "says"), [(["--version"], "clef-gguf "), (["decide", "--help"], "Usage: python -m clef_gguf.cli decide")]
)
def test_version_and_help_need_no_library(env, args, says):
    """--version and --help import no llama.cpp: they work where its libraries cannot load."""
    done = subprocess.run([sys.executable, "-m", "clef_gguf.cli", *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(says), done.stderr


def _installed_cuda_build_without_driver() -> str | None:
    """Why the installed llama-cpp-python is not a CUDA build on a machine without NVIDIA's driver (None: it is).
    Read from its files: importing clef_gguf.llama would load it."""
    import ctypes.util
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    folder = Path(next(iter(spec.submodule_search_locations))) / "lib" if spec and spec.submodule_search_locations else None
    if folder is None or not any(folder.glob("libggml-cuda.so*")):
        return "the installed llama-cpp-python is not a CUDA build (tools/cuda_check_here.sh installs one)"
    if ctypes.util.find_library("cuda"):
        return "this machine has NVIDIA's driver (libcuda): the CUDA build loads here"
    return None


@pytest.mark.skipif(_installed_cuda_build_without_driver() is not None, reason=str(_installed_cuda_build_without_driver()))
@pytest.mark.parametrize("args", [["demo"], ["demo", "-ngl", "-1"]])
def test_the_real_cuda_build_without_a_driver(args):
    """tools/cuda_check_here.sh: the CUDA wheel of tools/cuda_build.sh, installed here."""
    assert subprocess.run([sys.executable, "-c", "import clef_gguf"], capture_output=True).returncode == 0
    done = subprocess.run([sys.executable, "-m", "clef_gguf.cli", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "libcuda.so.1" in done.stderr and "no NVIDIA driver" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
