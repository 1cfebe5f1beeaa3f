"""How llama.cpp reads a view of a Clef file (llama/qwen35_view.py): the one place that chooses the route.

  cookie    glibc's fopencookie (llama/cookie_file.py): a FILE* whose reads are the view's, handed to
            llama_model_load_from_file_ptr and llama_adapter_lora_init_from_file_ptr. Linux with glibc only.
  portable  llama_model_init_from_user (llama/user_model.py): a model from the view's header and a callback that
            fills each tensor from the view; a LoRA adapter through a temporary file of its view (llama.cpp has no
            callback route for adapters), loaded by path and removed at once. Works wherever llama.cpp does.

CLEF_GGUF_LOADER (settings.LOADER_ENV) picks one: `auto` (the default: the cookie where glibc's fopencookie exists,
else portable), `cookie` or `portable`. Both give the same answers to the last digit (tests/test_portable_loader.py);
their costs are in docs/internals.md and docs/benchmarks.md.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp as L

from ..errors import ModelFileError, SettingsError, TemporarilyUnavailableError
from ..format.header import GGUFFile
from ..format.pinned import changed
from ..settings import LOADER_ENV
from . import cookie_file, cpu_buffers, user_model
from . import log as llama_log
from .qwen35_view import View, open_adapter_view, open_qwen35_view, view_tensor_names, write_view

AUTO, COOKIE, PORTABLE = "auto", "cookie", "portable"
ROUTES = (AUTO, COOKIE, PORTABLE)


def route() -> str:
    """The route this process loads by (COOKIE or PORTABLE), as CLEF_GGUF_LOADER asks; SettingsError for a value
    it cannot have. Read at each load: a forced portable route never loads libc.so.6 to find out."""
    asked = os.environ.get(LOADER_ENV, AUTO)
    if asked not in ROUTES:
        raise SettingsError(f"{LOADER_ENV} must be one of {', '.join(ROUTES)}, not {asked!r}")
    if asked == PORTABLE:
        return PORTABLE
    if cookie_file.available():
        return COOKIE
    if asked == COOKIE:
        raise SettingsError(f"{LOADER_ENV}=cookie needs glibc's fopencookie, which this system lacks: use auto or portable")
    return PORTABLE


def load_model(f: GGUFFile, lean: bool, params: L.llama_model_params) -> L.llama_model_p:
    """A view of `f` loaded by llama.cpp with `params` (llama/backbone.py sets the rest), its CPU weights placed
    by llama/cpu_buffers.py; ModelFileError where llama.cpp refuses it."""
    chosen = route()
    params.load_mode = L.LLAMA_LOAD_MODE_NONE  # neither route's stream can be mmapped (and the portable one forces it)
    tensors = {n: f.header.tensors[n] for n in view_tensor_names(f, lean)}
    placed = cpu_buffers.placement(tensors, n_gpu_layers=params.n_gpu_layers, by_override=chosen == PORTABLE)
    placed.apply(params)  # never AMX: it crashes there (cpu_buffers.py)
    llama_log.clear_errors()
    try:
        with open_qwen35_view(f, lean) as view:
            if chosen == COOKIE:
                model = _through_cookie(view, lambda fp: L.llama_model_load_from_file_ptr(fp, params))
            else:
                model = user_model.load(view, params)
            if model and view.changed():  # (a pinned base's file written while llama.cpp read it: two versions mixed)
                L.llama_model_free(model)
                raise ModelFileError(changed(f.path))
    except ModelFileError as e:
        raise ModelFileError(f"could not load the backbone of {f.path.name}: {e}") from None
    if not model:
        raise ModelFileError(f"llama.cpp could not load the backbone of {f.path.name}: {llama_log.last_error('no reason given')}")
    return model


def _through_cookie(view: View, load: Callable[[Any], Any]) -> Any:
    """load(fp) of a glibc cookie FILE* over `view`, the stream closed after (llama.cpp has read what it keeps)."""
    stream = cookie_file.CookieFile(view)
    try:
        return load(stream.fp)
    finally:
        stream.close()


def load_adapter(model: L.llama_model_p, f: GGUFFile, scratch: Path | None = None) -> Any:
    """The LoRA pairs of adapter file `f` loaded over `model`: a llama_adapter_lora *, or None where llama.cpp
    refused them (llama/log.py has its reason). The portable route's temporary file is written in `scratch` (the
    runtime's private folder: removed with it, whatever ends the process), else in the temporary folder; one that
    cannot be written (the disk full) is TemporarilyUnavailableError, and nothing of it is left."""
    chosen = route()
    llama_log.clear_errors()
    with open_adapter_view(f) as view:
        if chosen == COOKIE:
            return _through_cookie(view, lambda fp: L.llama_adapter_lora_init_from_file_ptr(model, fp))
        path = ""
        try:
            try:
                handle, path = tempfile.mkstemp(prefix="clef-lora-", suffix=".gguf", dir=scratch)
                os.close(handle)  # written by name, then read by llama.cpp by name (Windows opens a file once at a time)
                write_view(view, path)
            except OSError as e:
                why = f"{e.strerror or e}"
                raise TemporarilyUnavailableError(
                    f"the LoRA of {f.path.name} cannot be written for llama.cpp now ({why})"
                ) from None
            # ggml_fopen takes UTF-8 on Windows (it widens it), the file system's bytes elsewhere.
            return L.llama_adapter_lora_init(model, path.encode() if os.name == "nt" else os.fsencode(path))
        finally:
            if path:
                Path(path).unlink(missing_ok=True)
