"""The base is one immutable version, as an adapter is: once loaded, nothing the runtime reads of it comes from its path
(format/pinned.py, runtime/base_file.py). Truncating (the first thing `cp new.gguf served.gguf` does), rewriting with
another model of the same layout, replacing or deleting the base file under `serve`, with requests in flight, raises no
signal (it was SIGBUS, exit 135) and changes no answer and no Clef-Model-Sha256; a file changed while it loads is
refused, never loaded as two versions mixed."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from live_server import served

import clef_gguf
from clef_gguf.check.validate import open_validated
from clef_gguf.errors import ModelFileError
from clef_gguf.format.contract import is_head_tensor
from clef_gguf.format.header import GGUFFile
from clef_gguf.format.pinned import PinnedFile
from clef_gguf.testing.request_suite import flat_probabilities, labelled_requests

CONTEXT = 2048
CLOSE = 2e-4  # answers are rounded to 4 decimals; batching may move one by a unit or two
REQUESTS = labelled_requests(4)  # distinct states: each prefill gathers token embeddings again


def other_weights(base: Path, out: Path) -> Path:
    """`base` with other weights and the same layout: token_embd's and output.weight's rows reversed, the head's
    vectors scaled (finite, valid, answering otherwise; the norms kept: an adapter's fingerprint still fits)."""
    shutil.copyfile(base, out)
    f = GGUFFile.open(base)
    try:
        with open(out, "r+b") as w:
            for name, t in f.header.tensors.items():
                data = f.tensor_bytes(name).copy()
                if name in ("token_embd.weight", "output.weight"):
                    data = data.reshape(t.shape[0], -1)[::-1].reshape(-1)
                elif is_head_tensor(name) and t.type == GT.F32 and len(t.shape) == 1:
                    data = (data.view("<f4") * 1.5).view(np.uint8)
                else:
                    continue
                w.seek(f.header.data_offset + t.offset)
                w.write(data.tobytes())
    finally:
        f.close()
    return out


def answers(path: Path) -> tuple[list[list[float]], str]:
    with clef_gguf.load(path, max_prompt_tokens=CONTEXT, state_cache=0) as model:
        return [flat_probabilities(model.decide(r)) for r in REQUESTS], model.identity


@pytest.fixture(scope="module")
def pair(ws, tmp_path_factory) -> tuple[Path, Path]:
    """The base, and a file of its layout with other weights."""
    base = ws.gguf("untied_f32", "f32")
    return base, other_weights(base, tmp_path_factory.mktemp("base") / "other.gguf")


@pytest.fixture(scope="module")
def versions(pair):
    base, other = pair
    loaded, changed = answers(base), answers(other)
    assert loaded[1] != changed[1]
    assert max(np.abs(np.subtract(a, b)).max() for a, b in zip(loaded[0], changed[0], strict=True)) > 0.01
    return base, other, loaded


def _truncate(served: Path, other: Path) -> None:
    os.truncate(served, served.stat().st_size // 3)


def _rewrite(served: Path, other: Path) -> None:
    shutil.copyfile(other, served)  # `cp other served`: the same inode truncated, then written


def _replace(served: Path, other: Path) -> None:
    shutil.copyfile(other, served.with_suffix(".tmp"))
    os.replace(served.with_suffix(".tmp"), served)


def _delete(served: Path, other: Path) -> None:
    served.unlink()


@pytest.mark.slow
def test_serve_answers_as_the_version_it_loaded_whatever_happens_to_the_file(versions, tmp_path):
    base, other, (expected, identity) = versions
    target = tmp_path / "served.gguf"
    shutil.copyfile(base, target)
    with served(target, "--ctx", str(CONTEXT)) as (url, process), httpx.Client(base_url=url, timeout=120) as client:

        def ask(i: int) -> None:
            answer = client.post("/v1/systemone", json=REQUESTS[i % len(REQUESTS)])
            assert answer.status_code == 200, answer.text
            assert answer.headers["clef-model-sha256"] == identity
            got = flat_probabilities(answer.json())
            assert np.abs(np.subtract(got, expected[i % len(REQUESTS)])).max() <= CLOSE, i

        for change in (_truncate, _rewrite, _replace, _delete):
            with ThreadPoolExecutor(4) as pool:
                flying = [pool.submit(ask, i) for i in range(8)]
                change(target, other)  # while those are in flight
                flying += [pool.submit(ask, i) for i in range(8)]
                for done in flying:
                    done.result()
            assert process.poll() is None, change.__name__
            if not target.exists():
                shutil.copyfile(base, target)


@contextmanager
def _validated_copy(base: Path, tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    """A copy of `base` and its validation, open for the test's body."""
    target = tmp_path / "base.gguf"
    shutil.copyfile(base, target)
    validated = open_validated(target)
    try:
        yield target, validated
    finally:
        validated.close()


def test_a_file_changed_after_its_validation_is_not_pinned(pair, tmp_path):
    base, other = pair
    with _validated_copy(base, tmp_path) as (target, validated):
        shutil.copyfile(other, target)  # between the header's check and the copy of what the runtime reads
        with pytest.raises(ModelFileError, match="changed while it was loaded"):
            PinnedFile.pin(validated.file, ["token_embd.weight"])


def test_a_pinned_file_reads_only_its_own_version(pair, tmp_path):
    """Resident tensors from its own memory whatever the file becomes; any other only while the file is that version."""
    base, _ = pair
    with _validated_copy(base, tmp_path) as (target, validated):
        original = {n: validated.file.tensor_bytes(n).copy() for n in ("token_embd.weight", "output.weight")}
        pinned = PinnedFile.pin(validated.file, ["token_embd.weight"])
    try:
        assert (pinned.tensor_bytes("output.weight") == original["output.weight"]).all()  # (read from the file)
        os.truncate(target, 0)
        assert (pinned.tensor_bytes("token_embd.weight") == original["token_embd.weight"]).all()
        with pytest.raises(ModelFileError, match="no longer the version loaded"):
            pinned.tensor_bytes("output.weight")
    finally:
        pinned.close()


def test_a_pinned_file_reads_its_version_after_the_path_is_deleted_or_replaced(pair, tmp_path):
    """What an adapter's content check reads (any backbone row) comes from the version pinned, whatever the path names
    now: deleting the base or renaming another file onto it leaves every adapter loadable."""
    base, other = pair
    with _validated_copy(base, tmp_path) as (target, validated):
        original = validated.file.tensor_bytes("output.weight").copy()
        pinned = PinnedFile.pin(validated.file, ["token_embd.weight"])
    try:
        target.unlink()
        assert (pinned.tensor_bytes("output.weight") == original).all()
        shutil.copyfile(other, tmp_path / "new.gguf")
        os.replace(tmp_path / "new.gguf", target)
        assert (pinned.tensor_bytes("output.weight") == original).all()
    finally:
        pinned.close()


def test_the_models_listing_dates_the_version_loaded_and_reads_nothing_of_the_path(pair, tmp_path):
    from clef_gguf.server.app import _models_listing

    base, _ = pair
    target = tmp_path / "base.gguf"
    shutil.copyfile(base, target)
    os.utime(target, (1_700_000_000, 1_700_000_000))  # 2023-11-14
    with clef_gguf.load(target, max_prompt_tokens=CONTEXT, state_cache=0) as model:
        os.utime(target, (1_577_836_800, 1_577_836_800))  # `touch -d 2020-01-01`: the answers stay the old version's
        assert {m["release_date"] for m in _models_listing(model, frozenset())["models"]} == {"2023-11-14"}
        target.unlink()
        assert {m["release_date"] for m in _models_listing(model, frozenset())["models"]} == {"2023-11-14"}


def test_llama_cpp_never_loads_another_version_than_the_one_pinned(pair, tmp_path):
    """The backbone's load reads the file through a view (llama/qwen35_view.py): refused when the file is no longer
    the version pinned, rather than a backbone of one version under the embeddings and head of another."""
    from clef_gguf.llama.backbone import load_model

    base, other = pair
    target = tmp_path / "base.gguf"
    shutil.copyfile(base, target)
    validated = open_validated(target)
    try:
        pinned = PinnedFile.pin(validated.file, ["token_embd.weight"])
    finally:
        validated.close()
    try:
        shutil.copyfile(other, target)
        with pytest.raises(ModelFileError, match="changed while it was loaded"):
            load_model(pinned, lean=True)
    finally:
        pinned.close()


@pytest.mark.parametrize("change", [_delete, _replace])
def test_the_backbone_loads_the_version_pinned_when_the_path_is_deleted_or_replaced(pair, tmp_path, change):
    """Deleting the base (or renaming another file onto it) while it loads: llama.cpp reads the version pinned, through
    the pin's descriptor, never a traceback of a path that is gone."""
    import llama_cpp

    from clef_gguf.llama.backbone import load_model

    base, other = pair
    with _validated_copy(base, tmp_path) as (target, validated):
        pinned = PinnedFile.pin(validated.file, ["token_embd.weight"])
    try:
        change(target, other)
        llama_cpp.llama_model_free(load_model(pinned, lean=True))
    finally:
        pinned.close()


def test_a_view_of_a_file_gone_since_its_validation_is_a_model_file_error(tmp_path):
    from clef_gguf.llama.qwen35_view import View

    with pytest.raises(ModelFileError, match="changed while it was loaded"):
        View(b"", tmp_path / "gone.gguf", 0, [], PinnedFile(tmp_path / "gone.gguf", None, None))  # type: ignore[arg-type]
