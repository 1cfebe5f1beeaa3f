"""Everything that touches libllama, ggml or libclef_head through ctypes.

llama-cpp-python's libraries are loaded here, before any module of this package binds them, so that a build that
cannot load on this machine is one clear error (BackendUnavailableError) and not the dynamic loader's: a CUDA build
where no NVIDIA driver is installed (libcuda.so.1), or one whose CUDA runtime libraries are not found.
"""

from __future__ import annotations

from ..errors import BackendUnavailableError
from .backends import explain_load_failure

try:
    import llama_cpp
except (OSError, RuntimeError) as e:  # llama-cpp-python raises the loader's OSError as a RuntimeError of its own
    raise BackendUnavailableError(explain_load_failure(e)) from None

__all__ = ["llama_cpp"]
