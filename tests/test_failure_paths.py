"""Every failure while loading closes what the earlier stages opened: no file descriptor, no mapping, no model.

A failure is injected at each load stage (validation, the base's pinned copy, the two llama.cpp models, the
embedding rows, the context, the native head, the probe decision); afterwards the process holds neither a
descriptor of the model file (/proc/self/fd) nor a mapping of it (/proc/self/maps), and every
llama.cpp model and context made was freed. Then the same file loads, holding neither once loaded, and closes
cleanly. On both of llama/loader.py's routes, each counted where it makes its models: the cookie route through a
FILE* (llama_model_load_from_file_ptr), the portable one from a header and a callback (llama_model_init_from_user),
which has a failure of its own: a tensor the callback cannot fill.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import clef_gguf
from clef_gguf.errors import ClefError, ModelFileError, ModelOutputError
from clef_gguf.llama import backbone, cookie_file, native_head, user_model
from clef_gguf.llama.loader import COOKIE, PORTABLE
from clef_gguf.runtime import base_file
from clef_gguf.runtime import model as runtime_model
from clef_gguf.settings import LOADER_ENV
from clef_gguf.testing.gguf_bytes import rebuild


def held(path: Path) -> list[str]:
    """What the process holds of `path`: descriptors and mappings."""
    target = str(path.resolve())
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                found.append(f"fd {fd}")
        except OSError:
            pass  # closed while listing (the listing's own descriptor)
    with open("/proc/self/maps") as maps:
        found += [line.strip() for line in maps if line.rstrip().endswith(target)]
    return found


def _fail(*_: object, **__: object) -> None:
    raise ModelFileError("injected failure")


def _second_call_fails(real: Callable) -> Callable:
    calls = []

    def load(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            _fail()
        return real(*args, **kwargs)

    return load


def _no_context(*_: object) -> None:
    return None  # what llama_init_from_model returns when it cannot allocate


def _probe_fails(self: runtime_model.ClefModel, request: object) -> dict:
    raise ModelOutputError("injected: the probe's scores are not finite")


def _fill_fails(self: user_model._Filler, tensor: int) -> None:
    raise ModelFileError("injected: a tensor the view cannot fill")


STAGES: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "base pinned": lambda mp: mp.setattr(base_file.PinnedFile, "pin", _fail),
    "vocabulary model": lambda mp: mp.setattr(backbone, "load_model", _fail),
    "lean model": lambda mp: mp.setattr(backbone, "load_model", _second_call_fails(backbone.load_model)),
    "embedding rows": lambda mp: mp.setattr(backbone, "RowTable", _fail),
    "context": lambda mp: mp.setattr(backbone.L, "llama_init_from_model", _no_context),
    "native head": lambda mp: mp.setattr(native_head.NativeHead, "__init__", _fail),
    "probe decision": lambda mp: mp.setattr(runtime_model.ClefModel, "decide", _probe_fails),
    # (llama.cpp has made the model when its callback fails: user_model.load frees it)
    "a tensor's fill": lambda mp: mp.setattr(user_model._Filler, "_fill", _fill_fails),
}
ROUTE_STAGES = {"a tensor's fill": PORTABLE}  # the stages of one route only
# Where each route makes its models (llama/loader.py); contexts are made alike on both.
MAKES_MODELS = {COOKIE: "llama_model_load_from_file_ptr", PORTABLE: "llama_model_init_from_user"}
ROUTES = [COOKIE, PORTABLE] if cookie_file.available() else [PORTABLE]
CASES = [(route, stage) for route in ROUTES for stage in STAGES if ROUTE_STAGES.get(stage, route) == route]


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The loader's route this test loads by (CLEF_GGUF_LOADER), each in turn."""
    monkeypatch.setenv(LOADER_ENV, request.param)
    return request.param


@pytest.fixture
def model_copy(ws, tmp_path: Path) -> Path:
    """A file of its own, so that what other tests keep loaded does not show in /proc."""
    return Path(shutil.copy(ws.gguf("untied_f32", "q8_0"), tmp_path / "model.gguf"))


class LlamaObjects:
    """The llama.cpp models and contexts made and freed while it is installed, models made by `route`."""

    def __init__(self, mp: pytest.MonkeyPatch, route: str) -> None:
        self.made: list[int] = []
        self.freed: list[int] = []
        for make in (MAKES_MODELS[route], "llama_init_from_model"):
            mp.setattr(backbone.L, make, self._made(getattr(backbone.L, make)))
        for free in ("llama_model_free", "llama_free"):
            mp.setattr(backbone.L, free, self._freed(getattr(backbone.L, free)))

    def _made(self, real: Callable) -> Callable:
        def make(*args: object) -> object:
            made = real(*args)
            if made:
                self.made.append(made)
            return made

        return make

    def _freed(self, real: Callable) -> Callable:
        def free(pointer: object) -> None:
            self.freed.append(pointer)
            real(pointer)

        return free

    def leaked(self) -> int:
        return len(self.made) - len(self.freed)


@pytest.mark.parametrize(("route", "stage"), CASES, indirect=["route"])
def test_a_failed_load_leaves_nothing_open(route: str, model_copy: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    assert held(model_copy) == []
    with monkeypatch.context() as mp:
        objects = LlamaObjects(mp, route)
        STAGES[stage](mp)
        with pytest.raises(ClefError) as failure:
            clef_gguf.load(model_copy, max_prompt_tokens=512)
    del failure  # its traceback holds the frames of the failed load
    gc.collect()
    assert held(model_copy) == [], stage
    assert objects.leaked() == 0, f"{stage}: {objects.leaked()} llama.cpp models or contexts not freed"
    with monkeypatch.context() as mp:
        objects = LlamaObjects(mp, route)
        with clef_gguf.load(model_copy, max_prompt_tokens=512) as model:  # the file itself is fine
            # The base pinned (format/pinned.py): once loaded, no mapping of it is held, one descriptor only (the
            # version pinned, where an adapter's content check reads its rows whatever the path becomes).
            assert [h.split()[0] for h in held(model_copy)] == ["fd"] and len(objects.made) == 3  # two models, one context
            model.decide(runtime_model.PROBE)
        assert held(model_copy) == [] and objects.leaked() == 0  # close() released it all, the object still alive


def test_a_file_validation_refuses_leaves_nothing_open(route: str, model_copy: Path) -> None:
    broken = rebuild(model_copy, model_copy.with_name("no-head.gguf"), keep=lambda name: name != "decision.scales")
    with pytest.raises(ModelFileError):
        clef_gguf.load(broken, max_prompt_tokens=512)
    gc.collect()
    assert held(broken) == []
