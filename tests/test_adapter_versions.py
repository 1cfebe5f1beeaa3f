"""One loaded adapter is one immutable thing.

An adapter file's version is read once into a private copy, validated, named by the identity of those bytes, and
loaded from that copy (runtime/adapter_files.py, runtime/catalog.py). A file replaced on disk is a new version (a new
identity: no cached state of the old version serves it); a file truncated or turned into a FIFO is refused, and the
server goes on. A folder of thousands of files is listed once per change, and an unknown name's 422 stays small. The
names the base answers to (Clef's, the base's own general.name, jev-latest) are the base's, with adapters too.

Adapters: tests/peft_adapters.py (random LoRA pairs and a moved head over the untied fixture release, in seconds);
references: the base loaded with the one adapter file alone.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from peft_adapters import peft_adapter

import clef_gguf
from clef_gguf.errors import AdapterUnavailableError, RequestError, SettingsError
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests

CONTEXT = 2048
CLOSE = 2e-4  # answers are rounded to 4 decimals; float noise may move one by a unit or two
REQUEST = labelled_requests(1)[0]


class Files:
    """The base's f32 file and three adapter files over it, each answering otherwise."""

    def __init__(self, ws, root: Path) -> None:
        release = ws.release("untied_f32")
        self.base = ws.gguf("untied_f32", "f32")
        self.one, self.two, self.three = (peft_adapter(release, root, n, seed=s) for s, n in enumerate(("one", "two", "three")))


@pytest.fixture(scope="module")
def files(ws, tmp_path_factory) -> Files:
    return Files(ws, tmp_path_factory.mktemp("versions"))


@pytest.fixture(scope="module")
def alone(files):
    """(answer, identity) of REQUEST for each adapter file alone over the base, and for the base."""
    out = {}
    for key, path in (("one", files.one), ("two", files.two), ("three", files.three), (None, None)):
        adapters = {"a": path} if path is not None else None
        with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapters=adapters, state_cache=0) as model:
            asked = _as("a" if path is not None else None, REQUEST)
            out[key] = (flat_probabilities(model.decide(asked)), model.encode(asked).identity)
    assert np.abs(np.subtract(out["one"][0], out["two"][0])).max() > 0.01  # the versions answer otherwise
    return out


def _as(name: str | None, request: dict) -> dict:
    return {**request, "model": name} if name is not None else request


def _far(a: list[float], b: list[float]) -> float:
    return float(np.abs(np.subtract(a, b)).max())


def _copy_over(new: Path, target: Path) -> None:
    """`cp new target`: the same inode, rewritten in place."""
    shutil.copyfile(new, target)


def _rename_over(new: Path, target: Path) -> None:
    """`cp new tmp && mv tmp target`: another inode under the old name."""
    shutil.copyfile(new, target.with_suffix(".tmp"))
    os.replace(target.with_suffix(".tmp"), target)


def _folder(tmp_path: Path, files: Files) -> Path:
    folder = tmp_path / "tunes"
    folder.mkdir()
    shutil.copyfile(files.one, folder / "a.adapter.gguf")
    shutil.copyfile(files.three, folder / "b.adapter.gguf")
    return folder


@pytest.mark.parametrize("swap", [_copy_over, _rename_over], ids=["cp", "rename"])
@pytest.mark.slow
def test_a_file_swapped_after_eviction_answers_as_the_new_file_alone(files, alone, tmp_path, swap):
    """max_adapters 1: `a` used, evicted by `b`, its file replaced: the next answer for `a` is the new file's (its
    identity too), and the states cached for the old version serve it not."""
    folder = _folder(tmp_path, files)
    with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, max_adapters=1) as model:
        first = model.decide(_as("a", REQUEST))
        assert model.encode(_as("a", REQUEST)).identity == alone["one"][1]
        assert model.decide(_as("a", REQUEST))["usage"]["input_tokens_details"]["cached_tokens"] > 0  # (cached: v1)
        model.decide(_as("b", REQUEST))
        assert model.decider.loaded == ["b"]
        swap(files.two, folder / "a.adapter.gguf")
        after = model.decide(_as("a", REQUEST))
        identity = model.encode(_as("a", REQUEST)).identity
        again = model.decide(_as("a", REQUEST))
    assert _far(flat_probabilities(first), alone["one"][0]) <= CLOSE
    assert identity == alone["two"][1] != alone["one"][1]
    assert after["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert _far(flat_probabilities(after), alone["two"][0]) <= CLOSE
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the new version's own states, cached
    assert _far(flat_probabilities(again), alone["two"][0]) <= CLOSE


def test_a_prompt_encoded_before_a_swap_is_answered_by_its_version_or_refused(files, alone, tmp_path):
    """Its version while it is loaded; once evicted, that version is gone from disk: AdapterUnavailableError."""
    folder = _folder(tmp_path, files)
    with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, max_adapters=1, state_cache=0) as model:
        early = model.encode(_as("a", REQUEST))
        model.decide(early)
        _rename_over(files.two, folder / "a.adapter.gguf")
        assert _far(flat_probabilities(model.decide(early)), alone["one"][0]) <= CLOSE  # (v1, still loaded)
        model.decide(_as("b", REQUEST))  # evicts it
        with pytest.raises(AdapterUnavailableError, match="changed"):
            model.decide(early)
        assert _far(flat_probabilities(model.decide(_as("a", REQUEST))), alone["two"][0]) <= CLOSE
        assert _far(flat_probabilities(model.decide(REQUEST)), alone[None][0]) <= CLOSE


def test_the_base_answers_to_its_names_and_no_adapter_takes_one(files, alone, tmp_path):
    """jev-latest (typesafe-sdk's default), Clef's names and the base's general.name are the base's with adapters;
    an adapter named like the base is refused at load, and a folder file so named is neither listed nor loaded."""
    folder = _folder(tmp_path, files)
    with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, state_cache=0) as base:
        name = base.name
    shutil.copyfile(files.one, folder / f"{name}.adapter.gguf")
    with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, state_cache=0) as model:
        for asked in ("jev-latest", "clef", "clef-flash", name):
            answer = model.decide(_as(asked, REQUEST))
            assert _far(flat_probabilities(answer), alone[None][0]) <= CLOSE, asked
            assert model.encode(_as(asked, REQUEST)).identity == alone[None][1], asked
        assert model.adapter_names() == ["a", "b"]
    for taken in (name, "jev-latest"):
        with pytest.raises(SettingsError, match="none of the base's names"):
            clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapters={taken: files.one})
    with pytest.raises(SettingsError, match="is a file, not a folder"):
        clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=files.one)


def test_listing_says_why_bad_files_are_refused_and_they_are_422s_naming_the_file(files, tmp_path):
    """Not GGUF, empty, truncated, a model, a FIFO: each a RequestError on field `model` naming the file name, never
    the server's folder; the names that load are the files that load, and /v1/models' listing gives each bad file's
    reason, the 422's own."""
    folder = _folder(tmp_path, files)
    (folder / "text.adapter.gguf").write_text("not a model")
    (folder / "empty.adapter.gguf").touch()
    (folder / "half.adapter.gguf").write_bytes(files.one.read_bytes()[: files.one.stat().st_size // 2])
    shutil.copyfile(files.base, folder / "model.adapter.gguf")
    os.mkfifo(folder / "pipe.adapter.gguf")
    with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, state_cache=0) as model:
        assert model.adapter_names() == ["a", "b"]
        for bad, why in (("text", "not a GGUF"), ("empty", "empty"), ("half", "truncated"), ("model", "not an adapter")):
            with pytest.raises(RequestError, match=why) as refused:
                model.encode(_as(bad, REQUEST))
            assert refused.value.field == "model" and f"{bad}.adapter.gguf" in str(refused.value), str(refused.value)
            assert str(folder) not in str(refused.value) and "clef-adapters-" not in str(refused.value)
        with pytest.raises(RequestError, match="pipe.adapter.gguf is a FIFO"):
            model.encode(_as("pipe", REQUEST))
        refused = {listed.name: listed.refused for listed in model.adapter_listing() if listed.identity is None}
        assert set(refused) == {"text", "empty", "half", "model", "pipe"}, refused
        for name, why in refused.items():
            with pytest.raises(RequestError) as again:
                model.encode(_as(name, REQUEST))
            assert why == again.value.reason and f"{name}.adapter.gguf" in why and str(folder) not in why


def test_a_folder_of_20000_files_is_listed_once_per_change(files, tmp_path):
    """An unknown name's 422 is a count and a few near names (under 1 KB), at once: the folder is listed again only
    when it changes (here: a file added with the folder's mtime put back is not seen until the mtime moves)."""
    folder = _folder(tmp_path, files)
    for i in range(20_000):
        (folder / f"tune-{i:05d}.adapter.gguf").touch()
    with clef_gguf.load(files.base, max_prompt_tokens=CONTEXT, adapter_dir=folder, state_cache=0) as model:
        with pytest.raises(RequestError) as refused:
            model.encode(_as("tune-1234x", REQUEST))
        message = str(refused.value)
        assert len(message.encode()) < 1024 and "20002 adapters" in message, message
        assert len(re.findall(r"tune-12\d{3}", message)) == 5, message  # the nearest five
        started = time.perf_counter()
        for i in range(50):
            with pytest.raises(RequestError):
                model.encode(_as(f"nope-{i}", REQUEST))
        per_request = (time.perf_counter() - started) / 50
        assert per_request < 0.05, per_request  # a rescan of 20,000 files with a stat each took ~0.2 s here
        before = os.stat(folder)
        (folder / "zebra-tune.adapter.gguf").touch()
        os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))  # the folder "unchanged": no new listing
        with pytest.raises(RequestError) as cached:
            model.encode(_as("zebra-tun", REQUEST))
        assert "zebra-tune" not in str(cached.value) and "20002 adapters" in str(cached.value)
        os.utime(folder)  # now it changed
        with pytest.raises(RequestError, match="zebra-tune") as listed:
            model.encode(_as("zebra-tun", REQUEST))
        assert "20003 adapters" in str(listed.value)
        assert model.adapter_names() == ["a", "b"]  # (the empty files do not load)


@pytest.mark.slow
def test_serve_outlives_a_truncated_adapter_and_a_fifo(files, alone, tmp_path):
    """`serve --adapter-dir --max-adapters 1`: an evicted adapter truncated in place is a 503 (it killed the server
    with SIGBUS); a FIFO named by requests is refused at once while base requests sent with them answer; the file
    renamed over with a new version answers as that version alone, its identity in Clef-Model-Sha256."""
    import httpx
    from live_server import served

    folder = _folder(tmp_path, files)
    os.mkfifo(folder / "pipe.adapter.gguf")
    args = ("--ctx", str(CONTEXT), "--adapter-dir", str(folder), "--max-adapters", "1")
    with served(files.base, *args) as (url, process), httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/v1/systemone", json=_as("a", REQUEST)).status_code == 200
        assert client.post("/v1/systemone", json=_as("b", REQUEST)).status_code == 200  # (a evicted)
        os.truncate(folder / "a.adapter.gguf", files.one.stat().st_size // 2)
        gone = client.post("/v1/systemone", json=_as("a", REQUEST))
        assert gone.status_code == 503 and "a.adapter.gguf" in gone.text and str(folder) not in gone.text, gone.text
        assert process.poll() is None
        for name, key in (("b", "three"), (None, None), ("jev-latest", None)):
            answer = client.post("/v1/systemone", json=_as(name, REQUEST))
            assert answer.status_code == 200 and _far(flat_probabilities(answer.json()), alone[key][0]) <= CLOSE, name
        sent = [_as("pipe", REQUEST), REQUEST] * 4
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda body: client.post("/v1/systemone", json=body, timeout=30), sent))
        for body, response in zip(sent, got, strict=True):
            if body.get("model") == "pipe":
                assert response.status_code == 422 and "pipe.adapter.gguf is a FIFO" in response.text, response.text
            else:
                assert response.status_code == 200, response.text
        _rename_over(files.two, folder / "a.adapter.gguf")
        back = client.post("/v1/systemone", json=_as("a", REQUEST))
        assert back.status_code == 200 and _far(flat_probabilities(back.json()), alone["two"][0]) <= CLOSE
        assert back.headers.get("clef-model-sha256") == alone["two"][1]
        listed = {m["name"]: m for m in client.get("/v1/models").json()["models"]}
        assert (listed["a"]["state"], listed["b"]["state"]) == ("resident", "on_disk")  # (--max-adapters 1: a last)
        assert listed["pipe"]["state"] == "refused" and "pipe.adapter.gguf is a FIFO" in listed["pipe"]["reason"]
