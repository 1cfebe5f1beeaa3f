"""The native head (libclef_head, a ggml graph) against the numpy reference (tests/numpy_head.py),
one ggml in the process, and prefill in several ubatches."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from conftest import f16_tiles, offloaded
from gguf import GGMLQuantizationType as GT
from numpy_head import lexical_rows, reference_head

import clef_gguf
from clef_gguf.check.validate import validate
from clef_gguf.errors import ComputeError, ModelFileError
from clef_gguf.format import hparams
from clef_gguf.format.contract import QUESTION_TYPES
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama.native import library_path
from clef_gguf.llama.native_head import NativeHead
from clef_gguf.runtime.prompt import EncodedPrompt, EncodedQuestion, Question, Request
from clef_gguf.testing.gguf_bytes import rebuild
from clef_gguf.testing.request_suite import all_requests

pytestmark = pytest.mark.device  # in the device set (tests/conftest.py)

# (release, file type, head type, tolerance on |logit difference| relative to 1 + |logit|).
# With F32 head weights both sides compute in float32 (only the order of sums differs);
# F16 / Q8_0 weights make ggml round the activations to that type too, as llama.cpp does.
# "auto": the head's weights as llama.cpp's converter stores them (q8_0 files: Q8_0; q4_k_m: F32). A Q8_0
# head is held to the numpy reference on the wider k256 head: ggml's Q8_0 products also round the activations.
CASES = [
    ("untied_f32", "f32", "auto", 1e-4),
    ("tied_bf16", "q8_0", "f32", 1e-4),
    ("k256", "q4_k_m", "auto", 1e-4),
    ("k256", "f32", "f16", 5e-3),
    ("k256", "f32", "q8_0", 3e-2),
]


def random_prompt(rng: np.random.Generator, n_tokens: int, n_vocab: int, questions: int, max_options: int) -> EncodedPrompt:
    """Random spans (possibly overlapping: the head only averages) over random token ids."""

    def span(max_len: int = 12) -> tuple[int, int]:
        start = int(rng.integers(0, n_tokens - 1))
        return start, min(n_tokens, start + int(rng.integers(1, max_len + 1)))

    encoded = []
    for index in range(questions):
        kind = list(QUESTION_TYPES)[index % 3]
        n_options = int(rng.integers(2, max_options + 1))
        question = Question(f"q{index}", kind, None, tuple((str(i), None) for i in range(n_options)))
        encoded.append(EncodedQuestion(question, span(), tuple(span() for _ in range(n_options))))
    tokens = rng.integers(0, n_vocab, size=n_tokens).tolist()
    return EncodedPrompt(Request(None, "", tuple(q.question for q in encoded)), tokens, tuple(encoded))


@pytest.mark.parametrize(("release", "file_type", "head_type", "tolerance"), CASES)
def test_native_head_equals_the_numpy_reference(ws, release, file_type, head_type, tolerance):
    path = ws.gguf(release, file_type, head_type)
    f = GGUFFile.open(path)
    try:
        config = hparams.head_config(f.header)
        reference = reference_head(f, config)
        native = NativeHead(f, config, n_threads=2, gpu=offloaded())
        # such a device's rounding is what the split products undo (head_graph.cpp), at the same tolerance; the CPU's
        # F32 products never split; elsewhere the probe decides (F32 products in TF32 round their inputs too)
        assert native.split_products if f16_tiles(native.device) else native.device != "CPU" or not native.split_products
        n_vocab = f.header.tensors["token_embd.weight"].shape[0]
        rng = np.random.default_rng(0)
        # Few queries take the folded attention over the memory, many (17 questions of up to 9 options
        # over width 32 or 64) the per-head one: head_graph.cpp's folds(). 64 tokens need no padding
        # (head_graph.cpp's MEMORY_PAD), the others do.
        for n_tokens, questions, max_options in [(1, 1, 2), (40, 1, 2), (64, 3, 4), (300, 5, 6), (900, 17, 9)]:
            prompt = random_prompt(rng, max(n_tokens, 2), n_vocab, questions, max_options)
            hidden = rng.normal(0.0, 2.0, size=(len(prompt.tokens), config.hidden_size)).astype(np.float32)
            expected = reference(hidden, prompt, lexical_rows(f, prompt))
            got = native(hidden, prompt)
            assert [len(g) for g in got] == [len(e) for e in expected]
            for g, e in zip(got, expected, strict=True):
                np.testing.assert_allclose(g, e, rtol=tolerance, atol=tolerance)
        native.close()
    finally:
        f.close()


def test_span_means_split_into_chunks_give_the_same_logits(ws):
    """64 questions x 40 options over 6000 tokens: the averaging matrices are split in several chunks."""
    path = ws.gguf("untied_f32", "f32")
    f = GGUFFile.open(path)
    try:
        config = hparams.head_config(f.header)
        rng = np.random.default_rng(1)
        prompt = random_prompt(rng, 6000, f.header.tensors["token_embd.weight"].shape[0], 64, 40)
        hidden = rng.normal(0.0, 1.0, size=(6000, config.hidden_size)).astype(np.float32)
        expected = reference_head(f, config)(hidden, prompt, lexical_rows(f, prompt))
        head = NativeHead(f, config, n_threads=2, gpu=offloaded())
        got = head(hidden, prompt)
        np.testing.assert_allclose(np.concatenate(got), np.concatenate(expected), rtol=1e-4, atol=1e-4)
    finally:
        f.close()


def test_split_products_equal_the_plain_ones(ws, monkeypatch):
    """The graph a device that rounds to F16 gets (head_graph.cpp's split products), forced on the CPU, whose
    products are F32: the parts must add up to the same logits, only summed in another order."""
    path = ws.gguf("k256", "f32", "f32")
    f = GGUFFile.open(path)
    try:
        config = hparams.head_config(f.header)
        heads = {}
        for split in ("0", "1"):
            monkeypatch.setenv("CLEF_HEAD_SPLIT_PRODUCTS", split)
            heads[split] = NativeHead(f, config, n_threads=2, gpu=False)
            assert heads[split].split_products == (split == "1")
        rng = np.random.default_rng(3)
        n_vocab = f.header.tensors["token_embd.weight"].shape[0]
        for n_tokens, questions, max_options in [(40, 1, 2), (300, 5, 6), (900, 17, 9)]:
            prompt = random_prompt(rng, n_tokens, n_vocab, questions, max_options)
            hidden = rng.normal(0.0, 2.0, size=(n_tokens, config.hidden_size)).astype(np.float32)
            plain, split = (np.concatenate(heads[s](hidden, prompt)) for s in ("0", "1"))
            np.testing.assert_allclose(split, plain, rtol=2e-5, atol=2e-5)
    finally:
        f.close()


def test_decide_uses_the_native_head(ws):
    model = ws.model("untied_f32", "f32")
    assert isinstance(model.head, NativeHead) and model.head.device  # "CPU" here; "CUDA0" under tools/gpu_check.sh


def test_bad_spans_and_tokens_are_errors_not_crashes(ws):
    path = ws.gguf("untied_f32", "f32")
    f = GGUFFile.open(path)
    head = NativeHead(f, hparams.head_config(f.header), n_threads=1, gpu=offloaded())
    f.close()
    rng = np.random.default_rng(2)
    prompt = random_prompt(rng, 20, 100, 1, 2)
    hidden = np.zeros((20, head.hidden_size), dtype=np.float32)
    q = prompt.questions[0]
    for bad in [EncodedQuestion(q.question, (5, 5), q.option_spans), EncodedQuestion(q.question, q.span, ((0, 21), (1, 2)))]:
        with pytest.raises(ComputeError, match="span"):
            head(hidden, EncodedPrompt(prompt.request, prompt.tokens, (bad,)))
    with pytest.raises(ComputeError, match="vocabulary"):
        head(hidden, EncodedPrompt(prompt.request, [10**8] * 20, prompt.questions))
    with pytest.raises(ComputeError, match="hidden states"):
        head(hidden[:10], prompt)


def test_one_ggml_in_the_process(ws):
    """libclef_head resolves ggml's symbols to the libggml-base that libllama uses."""
    ws.model("untied_f32", "f32")
    dlsym = ctypes.CDLL(None).dlsym
    dlsym.restype = ctypes.c_void_p
    dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ours = ctypes.CDLL(str(library_path()))
    theirs = llama_cpp.llama_cpp._lib
    for symbol in (b"ggml_init", b"ggml_backend_dev_count", b"gguf_init_from_file"):
        assert dlsym(ours._handle, symbol) == dlsym(theirs._handle, symbol), symbol
    assert os.path.dirname(library_path()).endswith(os.path.join("clef_gguf", "_native"))


@pytest.mark.slow
@pytest.mark.parametrize("ubatch", [16, 500])
def test_prefill_in_ubatches_gives_the_same_hidden_states(ws, ubatch):
    path = ws.gguf("untied_f32", "f32")
    request = all_requests()["long_state"]
    whole = ws.model("untied_f32", "f32")
    prompt = whole.encode(request)
    assert len(prompt.tokens) > 2 * ubatch  # really split
    with clef_gguf.load(path, max_prompt_tokens=8192, ubatch=ubatch) as split:
        difference = np.abs(split.backbone.hidden_states(prompt.tokens) - whole.backbone.hidden_states(prompt.tokens))
        # Other ubatch sizes change ggml's summation order (and the DeltaNet chunking): float noise,
        # on hidden states of RMS ~1 and up to ~5 here.
        assert difference.max() < 5e-3 and difference.mean() < 5e-4, (difference.max(), difference.mean())
        ours, expected = split.decide(request)["answers"], whole.decide(request)["answers"]
    for qid, answer in expected.items():
        assert ours[qid].get("noul") == pytest.approx(answer.get("noul"), abs=2e-3)
        assert ours[qid].get("probabilities") == pytest.approx(answer.get("probabilities"), abs=2e-3)


def test_ubatch_out_of_range_is_refused(ws):
    with pytest.raises(ValueError, match="ubatch"):
        clef_gguf.load(ws.gguf("untied_f32", "f32"), max_prompt_tokens=1024, ubatch=2048)


def _retyped(src: Path, dst: Path, name: str, qtype: GT) -> Path:
    """`src` with tensor `name` stored as `qtype` (F64 or F16), from its F32 values."""
    f = GGUFFile.open(src)
    t = f.header.tensors[name]
    values = f.tensor_bytes(name).view(np.float32)
    data = values.astype(np.float64 if qtype == GT.F64 else np.float16).tobytes()
    f.close()
    return rebuild(src, dst, keep=lambda n: n != name, extra=[(name, t.dims, int(qtype), data)])


@pytest.mark.parametrize(
    ("name", "qtype", "accepted"),
    [
        ("decision.proj_question.weight", GT.F16, True),  # a matrix in a type of the table
        ("decision.proj_question.weight", GT.F64, False),  # a matrix in a type outside it
        ("decision.hidden_norm.bias", GT.F16, False),  # a vector: F32 only
    ],
)
def test_validate_and_the_native_head_accept_the_same_types(ws, tmp_path, name, qtype, accepted):
    """One table (contract.WEIGHT_TYPES, vectors F32), read by validate and handed to libclef_head."""
    path = _retyped(ws.gguf("untied_f32", "f32"), tmp_path / "retyped.gguf", name, qtype)
    report = validate(path)
    f = GGUFFile.open(path)
    try:
        config = hparams.head_config(f.header)
        if accepted:
            assert report.ok, report.summary
            NativeHead(f, config, n_threads=1, gpu=offloaded()).close()
        else:
            assert [p.check for p in report.problems] == ["types"] and name in report.summary
            with pytest.raises(ModelFileError, match=rf"{name} is \w+, (which the head does not run|expected F32)"):
                NativeHead(f, config, n_threads=1, gpu=offloaded())
    finally:
        f.close()
