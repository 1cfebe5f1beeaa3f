"""Which device backends the installed llama-cpp-python was built with, read from its files without loading them:
what the error says when they cannot load, and what -ngl can use."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

# libggml-<name>.so beside libllama.so (libggml-<name>.dylib on macOS, ggml-<name>.dll on Windows): the backends
# llama-cpp-python was built with.
DEVICE_BACKENDS = {"cuda": "CUDA", "vulkan": "Vulkan", "metal": "Metal", "hip": "ROCm", "sycl": "SYCL"}
CPU_REINSTALL = (
    "pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36, then pip install --force-reinstall "
    "--no-deps clef-gguf (its native head is compiled against that llama.cpp)"
)


def library_folder() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def built_backends() -> list[str]:
    """The device backends whose libraries llama-cpp-python installed (CUDA, Vulkan, ...)."""
    folder = library_folder()
    if folder is None:
        return []
    return [label for name, label in DEVICE_BACKENDS.items() if any(folder.glob(f"*ggml-{name}.*"))]


def explain_load_failure(error: Exception) -> str:
    """One line saying why llama-cpp-python's libraries do not load here, and what to do."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    # llama-cpp-python's own wrapping: "Failed to load shared library '<path>': <the loader's message>"
    reason = re.sub(r"^Failed to load shared library '[^']*': ", "", reason)
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:  # llama-cpp-python then loads its libraries from there alone: the likely cause, whatever the loader says
        return (
            f"llama-cpp-python's libraries cannot load ({reason}): LLAMA_CPP_LIB_PATH is set to {override!r}, where "
            "llama-cpp-python looks for libllama and the ggml libraries instead of its own: point it at a folder that "
            "holds them, or unset it"
        )
    backends = built_backends()
    if "CUDA" in backends and "libcuda.so" in reason:
        return (
            f"llama-cpp-python's libraries cannot load ({reason}): this llama-cpp-python is a CUDA build, and this "
            "machine has no NVIDIA driver (libcuda.so.1). Run it where the driver is installed, or install the CPU "
            f"build: {CPU_REINSTALL}"
        )
    if "CUDA" in backends and any(lib in reason for lib in ("libcudart", "libcublas")):
        return (
            f"llama-cpp-python's libraries cannot load ({reason}): this CUDA build needs CUDA 13's runtime and cuBLAS: "
            "pip install nvidia-cuda-runtime nvidia-cublas (CUDA 13), or install the CPU build: " + CPU_REINSTALL
        )
    built = f" (a build with {', '.join(backends)})" if backends else ""
    return f"llama-cpp-python's libraries cannot load{built}: {reason}. Reinstall it: {CPU_REINSTALL}"
