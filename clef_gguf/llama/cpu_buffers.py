"""Where llama.cpp may keep weights that stay on the CPU: the one place that decides.

ggml's CPU backend offers "extra" buffer types that repack weights for faster kernels,
in llama.cpp's order of preference: AMX (Intel Xeon with AMX) first, then CPU_REPACK
(AVX2 / AVX-512 / NEON layouts). llama-cpp-python 0.3.36's AMX path, built by GCC 12, dies with SIGILL on the
first multi-token decode of a Q8_0 or K-quant model, even for a plain qwen35 file loaded by path: GCC 12 drops the
stores of the tile configuration before `ldtilecfg` (docs/internals.md, "Intel CPUs with AMX";
ggml-org/llama.cpp#20824 reports it as a SIGSEGV). So:

  * no AMX among the extra types (AMD, older Intel, ARM): llama.cpp's default;
  * AMX present: extra types off (llama_model_params.use_extra_bufts). CPU_REPACK could
    be kept without AMX (repack=True: every weight it runs is put there by a tensor
    buffer override; ggml itself answers which, through native/cpu_bufts.cpp, as
    llama.cpp's loader asks it), but on the AMX Xeon measured it made Q4_K_M prefill
    11-26% slower (tools/bench/bench_cpu_repack.py, README), so it is not the default there.
  * AMX present and layers offloaded to a GPU: extra types off and no overrides (an
    override would pin a layer to the CPU).
  * the portable loader (llama/loader.py), whose llama_model_init_from_user ignores
    use_extra_bufts: CPU_REPACK by overrides, as with AMX (by_override=True).

The native head keeps its weights in the CPU's default buffer type: never AMX.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache

import llama_cpp as L

from ..format.header import GGUFFile, TensorInfo
from . import native

AMX = "AMX"
REPACK = "CPU_REPACK"
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
log = logging.getLogger("clef_gguf")


class _BuftOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override (llama.h); llama-cpp-python binds the field as a void*."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@cache
def extra_buffer_types() -> tuple[str, ...]:
    """The CPU device's extra buffer types, as ggml reports them ("AMX", "CPU_REPACK", ...)."""
    lib = native.library()
    size = lib.clef_cpu_extra_buft_names(None, 0) + 1
    out = ctypes.create_string_buffer(size)
    lib.clef_cpu_extra_buft_names(out, size)
    return tuple(name for name in out.value.decode().split(",") if name)


@dataclass(frozen=True)
class Placement:
    """llama_model_params settings for CPU weights."""

    use_extra_bufts: bool
    repacked: tuple[str, ...] = ()  # tensors routed to CPU_REPACK by override
    _overrides: ctypes.Array | None = field(default=None, repr=False)
    _patterns: tuple[bytes, ...] = field(default=(), repr=False)  # the strings the array points to

    def apply(self, params: L.llama_model_params) -> None:
        params.use_extra_bufts = self.use_extra_bufts
        if self._overrides is not None:
            params.tensor_buft_overrides = ctypes.addressof(self._overrides)  # a NULL-terminated array
            params._clef_overrides = self  # llama.cpp reads the array and its strings during the load


def _patterns(names: list[str]) -> list[str]:
    """Few regexes for many names: llama.cpp compiles each pattern again for every tensor."""
    by_suffix: dict[str, list[str]] = defaultdict(list)
    singles = []
    for name in names:
        m = _BLOCK.match(name)
        if m:
            by_suffix[m[2]].append(m[1])
        else:
            singles.append(name)
    patterns = [f"^blk\\.({'|'.join(blocks)})\\.{re.escape(suffix)}$" for suffix, blocks in by_suffix.items()]
    return patterns + [f"^{re.escape(name)}$" for name in singles]


def placement(
    tensors: Mapping[str, TensorInfo], *, n_gpu_layers: int = 0, repack: bool | None = None, by_override: bool = False
) -> Placement:
    """How llama.cpp may place the CPU weights among `tensors` (the model it loads, as llama_model_params.n_gpu_layers).

    repack: whether CPU_REPACK may hold weights; None is the measured default (yes without AMX, no with it).
    by_override: llama.cpp ignores use_extra_bufts (llama_model_init_from_user turns it off): CPU_REPACK by overrides
    alone, as where AMX is present (with layers offloaded, then no CPU_REPACK at all).
    """
    offload = n_gpu_layers != 0 and bool(L.llama_supports_gpu_offload())
    available = extra_buffer_types()
    if repack is None:
        repack = AMX not in available
    if AMX not in available and not by_override:
        chosen = Placement(use_extra_bufts=repack)
    elif offload or not repack or REPACK not in available:
        chosen = Placement(use_extra_bufts=False)
    else:
        lib = native.library()
        buft = lib.clef_cpu_extra_buft(REPACK.encode())
        names = [
            name
            for name, t in tensors.items()
            # token_embd is read by GET_ROWS, which no extra buffer type runs.
            if len(t.dims) == 2
            and name != "token_embd.weight"
            and lib.clef_cpu_buft_supports_weight(buft, int(t.type), t.dims[0], t.dims[1])
        ]
        patterns = tuple(p.encode() for p in _patterns(names))
        overrides = None
        if patterns:
            overrides = (_BuftOverride * (len(patterns) + 1))()  # the last entry stays {NULL, NULL}: the end
            for i, pattern in enumerate(patterns):
                overrides[i].pattern, overrides[i].buft = pattern, buft
        chosen = Placement(use_extra_bufts=False, repacked=tuple(names), _overrides=overrides, _patterns=patterns)
    log.debug(
        "CPU extra buffer types %s: use_extra_bufts=%s, %d weights routed to %s%s",
        ",".join(available) or "none",
        chosen.use_extra_bufts,
        len(chosen.repacked),
        REPACK,
        " (AMX left out: ggml-org/llama.cpp#20824)" if AMX in available else "",
    )
    return chosen


def for_gguf(path: str | os.PathLike[str], *, n_gpu_layers: int = 0, repack: bool | None = None) -> Placement:
    """The placement for llama.cpp loading a plain GGUF by path (tools, tests)."""
    f = GGUFFile.open(path)
    try:
        return placement(f.header.tensors, n_gpu_layers=n_gpu_layers, repack=repack)
    finally:
        f.close()
