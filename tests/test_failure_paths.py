"""Every failure while loading closes what the earlier stages opened: no file descriptor, no mapping, no model.

A failure is injected at each load stage (validation, the two llama.cpp models, the embedding rows,
the context, the native head, the probe decision); afterwards the process holds neither a
descriptor of the model file (/proc/self/fd) nor a mapping of it (/proc/self/maps), and every
llama.cpp model and context made was freed. Then the same file loads and closes cleanly.
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
from clef_gguf.llama import backbone, native_head
from clef_gguf.runtime import model as runtime_model
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


STAGES: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "vocabulary model": lambda mp: mp.setattr(backbone, "load_model", _fail),
    "lean model": lambda mp: mp.setattr(backbone, "load_model", _second_call_fails(backbone.load_model)),
    "embedding rows": lambda mp: mp.setattr(backbone, "RowTable", _fail),
    "context": lambda mp: mp.setattr(backbone.L, "llama_init_from_model", _no_context),
    "native head": lambda mp: mp.setattr(native_head.NativeHead, "__init__", _fail),
    "probe decision": lambda mp: mp.setattr(runtime_model.ClefModel, "decide", _probe_fails),
}


@pytest.fixture
def model_copy(ws, tmp_path: Path) -> Path:
    """A file of its own, so that what other tests keep loaded does not show in /proc."""
    return Path(shutil.copy(ws.gguf("untied_f32", "q8_0"), tmp_path / "model.gguf"))


class LlamaObjects:
    """The llama.cpp models and contexts made and freed while it is installed."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.made: list[int] = []
        self.freed: list[int] = []
        for make, free in (("llama_model_load_from_file_ptr", "llama_model_free"), ("llama_init_from_model", "llama_free")):
            mp.setattr(backbone.L, make, self._made(getattr(backbone.L, make)))
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


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failed_load_leaves_nothing_open(model_copy: Path, monkeypatch: pytest.MonkeyPatch, stage: str) -> None:
    assert held(model_copy) == []
    with monkeypatch.context() as mp:
        objects = LlamaObjects(mp)
        STAGES[stage](mp)
        with pytest.raises(ClefError) as failure:
            clef_gguf.load(model_copy, max_prompt_tokens=512)
    del failure  # its traceback holds the frames of the failed load
    gc.collect()
    assert held(model_copy) == [], stage
    assert objects.leaked() == 0, f"{stage}: {objects.leaked()} llama.cpp models or contexts not freed"
    with monkeypatch.context() as mp:
        objects = LlamaObjects(mp)
        with clef_gguf.load(model_copy, max_prompt_tokens=512) as model:  # the file itself is fine
            assert held(model_copy) and len(objects.made) == 3  # two models, one context
            model.decide(runtime_model.PROBE)
        assert held(model_copy) == [] and objects.leaked() == 0  # close() released it all, the object still alive


def test_a_file_validation_refuses_leaves_nothing_open(model_copy: Path) -> None:
    broken = rebuild(model_copy, model_copy.with_name("no-head.gguf"), keep=lambda name: name != "decision.scales")
    with pytest.raises(ModelFileError):
        clef_gguf.load(broken, max_prompt_tokens=512)
    gc.collect()
    assert held(broken) == []
