"""Invalid requests and oversized prompts fail with typed errors, before any compute."""

from __future__ import annotations

import copy
import io
import pickle

import llama_cpp as L
import numpy as np
import pytest
from PIL import Image

import clef_gguf
from clef_gguf import PromptTooLongError, RequestError
from clef_gguf.runtime.model import open_encoder
from clef_gguf.settings import ModelSpec
from clef_gguf.testing.request_suite import long_state_request, mixed_request


def _evaluated_tokens(model: clef_gguf.ClefModel) -> int:
    return L.llama_perf_context(model.backbone.ctx).n_p_eval


def _with(change) -> dict:
    request = copy.deepcopy(mixed_request())
    change(request)
    return request


def _first(request: dict) -> dict:
    return next(iter(request["questions"].values()))


def _choice(request: dict) -> dict:
    return next(q for q in request["questions"].values() if q["type"] == "choice")


def _score(request: dict) -> dict:
    return next(q for q in request["questions"].values() if q["type"] == "score")


INVALID = {
    "not an object": (lambda r: r.clear(), None),
    "no state": (lambda r: r.pop("state"), "state"),
    "state a number": (lambda r: r.update(state=3), "state"),
    "model not a string": (lambda r: r.update(model=7), "model"),
    "no questions": (lambda r: r.update(questions={}), "questions"),
    "65 questions": (lambda r: r.update(questions={f"q{i}": {"type": "noul"} for i in range(65)}), "questions"),
    "question not an object": (lambda r: r["questions"].update(bad="yes"), "questions.bad"),
    "unknown type": (lambda r: _first(r).update(type="rank"), ".type"),
    "instructions a number": (lambda r: _first(r).update(instructions=3), ".instructions"),
    "choice with one option": (lambda r: _choice(r).update(criteria={"a": "x"}), ".criteria"),
    "choice with 256 options": (lambda r: _choice(r).update(criteria={f"o{i}": None for i in range(256)}), ".criteria"),
    "choice as a list": (lambda r: _choice(r).update(criteria=["a", "b"]), ".criteria"),
    "choice description a number": (lambda r: _choice(r).update(criteria={"a": 1, "b": "x"}), ".criteria.a"),
    "score as a map": (lambda r: _score(r).update(criteria={"0": "low", "1": "high"}), ".criteria"),
    "score with 11 levels": (lambda r: _score(r).update(criteria=[str(i) for i in range(11)]), ".criteria"),
    "score with 1 level": (lambda r: _score(r).update(criteria=["only"]), ".criteria"),
    "score level null": (lambda r: _score(r).update(criteria=["low", None, "high"]), ".criteria.1"),
    "noul with other keys": (
        lambda r: r["questions"].update(n={"type": "noul", "criteria": {"maybe": "x"}}),
        "questions.n.criteria",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_requests_name_the_field_and_compute_nothing(ws, case):
    model = ws.model("untied_f32", "f32")
    change, field = INVALID[case]
    request = [] if case == "not an object" else _with(change)
    before = _evaluated_tokens(model)
    with pytest.raises(RequestError) as raised:
        model.decide(request)
    if field is not None:
        assert field in str(raised.value)
    assert _evaluated_tokens(model) == before


def test_an_oversized_prompt_names_its_size_the_limit_and_the_remedy(ws):
    model = clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=256)
    try:
        before = _evaluated_tokens(model)
        with pytest.raises(PromptTooLongError) as raised:
            model.decide(mixed_request())
        error = raised.value
        assert error.limit == 256 and error.n_tokens > 256
        assert str(error.n_tokens) in str(error) and "256" in str(error) and "--max-prompt-tokens" in str(error)
        assert _evaluated_tokens(model) == before
        small = {"model": "m", "state": "hi", "questions": {"q": {"type": "noul"}}}
        assert model.decide(small)["usage"]["input_tokens"] <= 256  # the model still works afterwards
    finally:
        model.close()


def test_a_valid_request_is_not_modified(ws):
    request = mixed_request()
    before = copy.deepcopy(request)
    ws.model("untied_f32", "f32").decide(request)
    assert request == before


def test_request_errors_keep_their_parts_across_processes():
    # A Ray Serve replica's error reaches the ingress pickled: it must map to the same HTTP error there.
    for error in (RequestError("must be a list of 2 to 10 levels", "questions.q.criteria"), PromptTooLongError(70000, 65536)):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert (again.field, again.reason) == (error.field, error.reason)
    assert pickle.loads(pickle.dumps(PromptTooLongError(70000, 65536))).limit == 65536


def test_the_prompt_encoder_encodes_as_the_model_without_its_weights(ws):
    # What the Ray Serve ingress encodes, a replica's ClefModel decides: the very prompt ClefModel.encode makes.
    path = ws.gguf("untied_f32", "f32")
    model = ws.model("untied_f32", "f32")
    encoder = open_encoder(ModelSpec.of(path, max_prompt_tokens=model.max_prompt_tokens))
    try:
        for request in (mixed_request(), long_state_request(paragraphs=3)):
            assert encoder.encode(request) == model.encode(request)
        assert (encoder.name, encoder.max_prompt_tokens) == (model.name, model.max_prompt_tokens)
        with pytest.raises(RequestError, match="questions"):
            encoder.encode({"state": "s"})
    finally:
        encoder.close()
        encoder.close()  # a second close does nothing


def test_the_prompt_encoder_sizes_images_as_the_model(ws, tmp_path):
    path, mmproj = ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32")
    image = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 200, 3), dtype=np.uint8)).save(image, "PNG")
    request = {**mixed_request(), "images": [image.getvalue()]}
    with clef_gguf.load(path, max_prompt_tokens=4096, mmproj=mmproj, state_cache=0) as model:
        encoder = open_encoder(ModelSpec.of(path, max_prompt_tokens=4096, mmproj=mmproj))
        try:
            encoded = encoder.encode(request)
            assert encoded == model.encode(request) and len(encoded.images) == 1
            assert encoder.image_limits == model.image_limits
        finally:
            encoder.close()
    without = open_encoder(ModelSpec.of(path, max_prompt_tokens=4096))
    try:
        with pytest.raises(RequestError, match="mmproj"):
            without.encode(request)
    finally:
        without.close()
