"""Every assumption llama.cpp's loader and graph make about a Clef file's hyperparameters and
tensors (docs/loader_assumptions.md) has a mutant here that validate refuses in one line.

For the mutants that stock llama.cpp does not refuse but aborts on (GGML_ASSERT: SIGABRT; a
division by zero: SIGFPE) a process of its own first shows the crash with validate bypassed, then
`clef-gguf decide` exits with validate's code 7 instead of a signal. Each is a child forked from a zygote
that imported llama.cpp and the CLI once (fork_helpers.py), not a new interpreter.
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from fork_helpers import Zygote, zygote
from gguf import GGUFValueType as VT

from clef_gguf.check.report import Verdict
from clef_gguf.check.validate import validate
from clef_gguf.data import DEMO_MODEL
from clef_gguf.format import contract as C
from clef_gguf.format.header import GGUFFile, Header
from clef_gguf.format.template import SYSTEMONE_TEMPLATE, PromptTemplate
from clef_gguf.testing.gguf_bytes import (
    Tensor,
    build,
    kv_array,
    kv_f32,
    kv_i32,
    kv_i32_array,
    kv_str,
    kv_str_array,
    kv_u32,
    kvs_of,
    tensors_of,
)

GT = gguf.GGMLQuantizationType
Edit = dict[str, Any]  # mutate()'s keyword arguments


def K(suffix: str) -> str:  # noqa: N802 - reads like the key it names
    return f"clef.{suffix}"


def mutate(src: Path, dst: Path, kv: dict[str, bytes] | None = None, drop: frozenset[str] = frozenset(), tensors=None) -> Path:
    """`src` with key-values replaced (or added) and dropped, and its tensor list edited by `tensors`."""
    f = GGUFFile.open(src)
    try:
        listed = tensors_of(f)
        dst.write_bytes(build(kvs_of(f, set(drop), kv), tensors(listed) if tensors else listed))
    finally:
        f.close()
    return dst


def _u32(h: Header, suffix: str) -> int:
    return int(h.get(K(suffix)))


def _rot(h: Header) -> int:
    return int(h.get(K("rope.dimension_count")) or _u32(h, "attention.key_length"))


def _full_attention_layer(h: Header) -> int:
    return next(i for i, recurrent in enumerate(h.get(K("attention.recurrent_layers"))) if not recurrent)


def _f16(tensor: Tensor) -> Tensor:
    name, dims, _, data = tensor
    return name, dims, int(GT.F16), np.frombuffer(data, dtype=np.float32).astype(np.float16).tobytes()


def _retype(name: str) -> Callable[[list[Tensor]], list[Tensor]]:
    return lambda ts: [_f16(t) if t[0] == name else t for t in ts]


def _insert_after(anchor: str, new: Tensor) -> Callable[[list[Tensor]], list[Tensor]]:
    return lambda ts: [x for t in ts for x in ((t, new) if t[0] == anchor else (t,))]


def _bias_f16(h: Header) -> Edit:
    """An optional q bias of a full-attention layer (llama.cpp creates and adds it), stored as F16."""
    layer = _full_attention_layer(h)
    rows = h.tensors[f"blk.{layer}.attn_q.weight"].dims[1]
    bias = (f"blk.{layer}.attn_q.bias", (rows,), int(GT.F16), np.zeros(rows, dtype=np.float16).tobytes())
    return {"tensors": _insert_after(f"blk.{layer}.attn_q.weight", bias)}


def _tokens(h: Header, edit: Callable[[list[str], list[int]], None]) -> Edit:
    tokens, types = list(h.get("tokenizer.ggml.tokens")), list(h.get("tokenizer.ggml.token_type"))
    edit(tokens, types)
    return {
        "kv": {
            "tokenizer.ggml.tokens": kv_str_array("tokenizer.ggml.tokens", tokens),
            "tokenizer.ggml.token_type": kv_i32_array("tokenizer.ggml.token_type", types),
        }
    }


def _empty_token_collides(tokens: list[str], types: list[int]) -> None:
    """llama.cpp loads an empty token i as "[EMPTY_i]": then two tokens have that text."""
    n = len(tokens)
    tokens[n - 1], tokens[n - 2] = "", f"[EMPTY_{n - 1}]"  # padding rows of the embedding


def _duplicate_token(tokens: list[str], types: list[int]) -> None:
    tokens[300] = tokens[301]


def _layers(h: Header, keep: list[int], interval: int) -> Edit:
    """The demo cut to the layers `keep` (renumbered), with `interval` deciding their types as llama.cpp does."""
    renamed = {f"blk.{old}.": f"blk.{new}." for new, old in enumerate(keep)}

    def tensors(ts: list[Tensor]) -> list[Tensor]:
        out = []
        for name, dims, qtype, data in ts:
            prefix = ".".join(name.split(".")[:2]) + "."
            if not name.startswith("blk."):
                out.append((name, dims, qtype, data))
            elif prefix in renamed:
                out.append((renamed[prefix] + name[len(prefix) :], dims, qtype, data))
        return out

    layers = [(i + 1) % interval != 0 for i in range(len(keep))]
    kv = {
        K("block_count"): kv_u32(K("block_count"), len(keep)),
        K("full_attention_interval"): kv_u32(K("full_attention_interval"), interval),
        K("attention.recurrent_layers"): kv_array(K("attention.recurrent_layers"), VT.BOOL, "b", [int(x) for x in layers]),
    }
    return {"kv": kv, "tensors": tensors}


def _kv(key: str, packed: Callable[[Header], bytes]) -> Callable[[Header], Edit]:
    return lambda h: {"kv": {key: packed(h)}}


def _template(text: str) -> Callable[[Header], Edit]:
    return _kv(C.KEY_TEMPLATE, lambda h: kv_str(C.KEY_TEMPLATE, text))


@dataclass(frozen=True)
class Mutant:
    id: str  # the row of docs/loader_assumptions.md
    edit: Callable[[Header], Edit]
    says: str  # what validate's message says
    crash: str | None = None  # how stock llama.cpp ends on it, validate bypassed (shown in a subprocess)


SECTIONS = K("rope.dimension_sections")
MUTANTS = [
    # Loader: llama_model_base::load_hparams and llama_model_qwen35::load_arch_hparams
    Mutant(
        "block-count-zero", _kv(K("block_count"), lambda h: kv_u32(K("block_count"), 0)), "block_count = 0 is outside", "SIGABRT"
    ),
    Mutant(
        "block-count-513",
        _kv(K("block_count"), lambda h: kv_u32(K("block_count"), 513)),
        "block_count = 513 is outside",
        "SIGABRT",
    ),
    Mutant("context-length-zero", _kv(K("context_length"), lambda h: kv_u32(K("context_length"), 0)), "is outside"),
    Mutant(
        "feed-forward-int32",
        _kv(K("feed_forward_length"), lambda h: kv_i32(K("feed_forward_length"), _u32(h, "feed_forward_length"))),
        "stored as INT32",
    ),
    Mutant(
        "feed-forward-array-length",
        _kv(
            K("feed_forward_length"),
            lambda h: kv_i32_array(K("feed_forward_length"), [_u32(h, "feed_forward_length")] * (_u32(h, "block_count") + 1)),
        ),
        "per-layer array",
    ),
    Mutant("head-count-missing", lambda h: {"drop": frozenset({K("attention.head_count")})}, "head_count is missing"),
    Mutant(
        "head-count-kv-not-a-divisor",
        _kv(K("attention.head_count_kv"), lambda h: kv_u32(K("attention.head_count_kv"), _u32(h, "attention.head_count") + 1)),
        "is not a multiple of head_count_kv",
    ),
    Mutant(
        "value-length-differs",
        _kv(K("attention.value_length"), lambda h: kv_u32(K("attention.value_length"), 2 * _u32(h, "attention.key_length"))),
        "!= value_length",
    ),
    Mutant("rms-eps-missing", lambda h: {"drop": frozenset({K("attention.layer_norm_rms_epsilon")})}, "epsilon is missing"),
    Mutant(
        "rms-eps-negative",
        _kv(K("attention.layer_norm_rms_epsilon"), lambda h: kv_f32(K("attention.layer_norm_rms_epsilon"), -1e-6)),
        "epsilon = ",
        crash="SIGABRT",
    ),
    Mutant(
        "rms-eps-nan",
        _kv(K("attention.layer_norm_rms_epsilon"), lambda h: kv_f32(K("attention.layer_norm_rms_epsilon"), math.nan)),
        "epsilon = nan",
        crash="SIGABRT",
    ),
    Mutant("freq-base-zero", _kv(K("rope.freq_base"), lambda h: kv_f32(K("rope.freq_base"), 0.0)), "freq_base = 0.0 is outside"),
    Mutant("freq-base-inf", _kv(K("rope.freq_base"), lambda h: kv_f32(K("rope.freq_base"), math.inf)), "freq_base = inf"),
    Mutant(
        "rope-dims-odd",
        _kv(K("rope.dimension_count"), lambda h: kv_u32(K("rope.dimension_count"), _rot(h) - 1)),
        "is odd",
        crash="SIGABRT",
    ),
    Mutant(
        "rope-dims-past-head-dim",
        _kv(K("rope.dimension_count"), lambda h: kv_u32(K("rope.dimension_count"), _u32(h, "attention.key_length") + 2)),
        "rope.dimension_count",
        crash="SIGABRT",
    ),
    Mutant("sections-missing", lambda h: {"drop": frozenset({SECTIONS})}, "dimension_sections is missing"),
    Mutant("sections-three", _kv(SECTIONS, lambda h: kv_i32_array(SECTIONS, [1, 1, 1])), "must be an array of 4 integers"),
    Mutant("sections-float", _kv(SECTIONS, lambda h: kv_array(SECTIONS, VT.FLOAT32, "f", [1.0] * 4)), "array of 4 integers"),
    Mutant("sections-negative", _kv(SECTIONS, lambda h: kv_i32_array(SECTIONS, [-1, 2, 1, 0])), "must be non-negative"),
    Mutant(
        "sections-all-zero",
        _kv(SECTIONS, lambda h: kv_i32_array(SECTIONS, [0, 0, 0, 0])),
        "clef.rope.dimension_sections = [0,0,0,0]: one of the first three sections must be positive",
        crash="SIGABRT",
    ),
    Mutant(
        "sections-only-fourth",
        _kv(SECTIONS, lambda h: kv_i32_array(SECTIONS, [0, 0, 0, 2])),
        "one of the first three sections must be positive",
        crash="SIGABRT",
    ),
    Mutant(
        "sections-past-head-dim",
        _kv(SECTIONS, lambda h: kv_i32_array(SECTIONS, [_u32(h, "attention.key_length"), 1, 0, 0])),
        "rotary pairs",
        crash="SIGABRT",
    ),
    Mutant(
        "interval-zero",
        lambda h: {
            "drop": frozenset({K("attention.recurrent_layers")}),
            "kv": {K("full_attention_interval"): kv_u32(K("full_attention_interval"), 0)},
        },
        "full_attention_interval = 0 is outside",
        crash="SIGFPE",
    ),
    Mutant(
        "recurrent-layers-disagree",
        _kv(
            K("attention.recurrent_layers"),
            lambda h: kv_array(K("attention.recurrent_layers"), VT.BOOL, "b", [1] * _u32(h, "block_count")),
        ),
        "disagrees with full_attention_interval",
    ),
    Mutant(
        "no-full-attention-layer",
        lambda h: _layers(h, [i for i, r in enumerate(h.get(K("attention.recurrent_layers"))) if r], 4),
        "have no full-attention layer",
        crash="SIGABRT",
    ),
    Mutant(
        "no-linear-attention-layer",
        lambda h: _layers(h, [_full_attention_layer(h)], 1),
        "have no linear-attention layer",
        crash="SIGABRT",
    ),
    Mutant("ssm-state-size-missing", lambda h: {"drop": frozenset({K("ssm.state_size")})}, "ssm.state_size is missing"),
    Mutant(
        "ssm-v-heads-not-a-multiple",
        _kv(K("ssm.time_step_rank"), lambda h: kv_u32(K("ssm.time_step_rank"), 2 * _u32(h, "ssm.group_count") + 1)),
        "is not a multiple of ssm.group_count",
    ),
    Mutant(
        "ssm-inner-size",
        _kv(K("ssm.inner_size"), lambda h: kv_u32(K("ssm.inner_size"), _u32(h, "ssm.inner_size") + _u32(h, "ssm.state_size"))),
        "ssm.inner_size",
        crash="SIGABRT",
    ),
    # Tensors: llama.cpp's create_tensor, and the types ggml's CPU ops take
    Mutant(
        "tensor-shape",
        lambda h: {"tensors": lambda ts: [(n, d[::-1] if n == "blk.0.ffn_up.weight" else d, q, b) for n, d, q, b in ts]},
        "backbone tensor blk.0.ffn_up.weight has shape",
    ),
    Mutant(
        "tensor-extra",
        lambda h: {"tensors": _insert_after("blk.0.ffn_up.weight", ("blk.0.extra.weight", (4,), int(GT.F32), bytes(16)))},
        "refuses tensors it does not create",
    ),
    Mutant("norm-f16", lambda h: {"tensors": _retype("blk.0.attn_norm.weight")}, "needs it in F32", crash="SIGABRT"),
    Mutant("conv1d-f16", lambda h: {"tensors": _retype("blk.0.ssm_conv1d.weight")}, "needs it in F32", crash="SIGABRT"),
    Mutant("bias-f16", _bias_f16, "needs it in F32", crash="SIGABRT"),
    # Vocabulary: llama_vocab::impl::load and its tokenizer
    Mutant(
        "tokenizer-model",
        _kv("tokenizer.ggml.model", lambda h: kv_str("tokenizer.ggml.model", "llama")),
        "not 'gpt2'",
        crash="SIGABRT",  # a C++ exception (unordered_map::at) through the C API: std::terminate
    ),
    Mutant("merges-missing", lambda h: {"drop": frozenset({"tokenizer.ggml.merges"})}, "merges is missing"),
    Mutant(
        "token-types-short",
        _kv("tokenizer.ggml.token_type", lambda h: kv_i32_array("tokenizer.ggml.token_type", [1] * 10)),
        "INT32 values, one per token",
    ),
    Mutant("duplicate-token", lambda h: _tokens(h, _duplicate_token), "the same token twice", crash="SIGABRT"),
    Mutant("empty-token-collides", lambda h: _tokens(h, _empty_token_collides), "[EMPTY_i]", crash="SIGABRT"),
    Mutant(
        "eos-out-of-range",
        _kv(
            "tokenizer.ggml.eos_token_id",
            lambda h: kv_u32("tokenizer.ggml.eos_token_id", len(h.get("tokenizer.ggml.tokens"))),
        ),
        "is not a UINT32 token id below",
    ),
    # The systemone prompt template: rendered in Jinja's sandbox, only the constructs the real one uses
    Mutant("template-call", _template("{{ range(1000000000) | join }}"), "uses Call"),
    Mutant("template-loop", _template("{% for q in questions %}{% for x in q.id %}x{% endfor %}{% endfor %}"), "loops over"),
    Mutant("template-nested-loops", _template("{% for q in state %}{% for r in state %}x{% endfor %}{% endfor %}"), "loops over"),
    Mutant("template-filter", _template("{{ state | upper }}"), "the filter 'upper'"),
    Mutant("template-macro", _template("{% macro m() %}x{% endmacro %}{{ m }}"), "uses Macro"),
    Mutant("template-syntax", _template("{{ state "), "does not parse"),
]


@pytest.fixture(scope="module")
def demo_header() -> Header:
    f = GGUFFile.open(DEMO_MODEL)
    yield f.header
    f.close()


def _mutant(m: Mutant, header: Header, folder: Path) -> Path:
    return mutate(DEMO_MODEL, folder / f"{m.id}.gguf", **m.edit(header))


def test_the_demo_model_is_the_unmutated_control():
    assert validate(DEMO_MODEL).ok


def test_the_table_lists_every_mutant():
    table = (Path(__file__).parents[1] / "docs" / "loader_assumptions.md").read_text()
    assert not [m.id for m in MUTANTS if f"`{m.id}`" not in table]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_validate_refuses_each_mutant_in_one_line(mutant, demo_header, tmp_path):
    report = validate(_mutant(mutant, demo_header, tmp_path))
    assert report.verdict in (Verdict.INCOMPLETE, Verdict.CORRUPT), report.summary
    assert any(mutant.says in p.message for p in report.problems), [p.message for p in report.problems]
    assert "\n" not in report.summary


# --- In a process of its own: the crash validate prevents, and decide exiting with validate's code -----
BYPASS = """
import sys
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama.backbone import Backbone

backbone = Backbone(GGUFFile.open(sys.argv[1]), max_prompt_tokens=64)  # no validate: straight to llama.cpp
backbone.hidden_states(backbone.tokenize("<|im_start|>user\\nIs this a complaint?<|im_end|>"))
"""
CRASHES = [m for m in MUTANTS if m.crash]
# ggml's abort handler attaches gdb for a backtrace: slow, and with two threads asserting at once
# it can take minutes. The signal is what this test is about.
NO_BACKTRACE = {**os.environ, "GGML_NO_BACKTRACE": "1"}
# What BYPASS and `decide` import, and what typer and rich import when the app runs: once, in the zygote.
PRELOAD = ("clef_gguf.cli.decide", "clef_gguf.runtime.model", "clef_gguf.runtime.reader", "clef_gguf.llama.backbone")
PRELOAD_TYPER = ("typer._adapters", "pydantic.plugin._loader", "rich._emoji_codes")


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> Iterator[Zygote]:
    """`python -c`/`-m` for each case, in a process of its own forked from one that imported them once."""
    with zygote(tmp_path_factory.mktemp("zygote"), *PRELOAD, *PRELOAD_TYPER, env=NO_BACKTRACE) as forks:
        yield forks


@pytest.mark.parametrize("mutant", CRASHES, ids=lambda m: m.id)
def test_stock_llama_cpp_crashes_on_the_mutant(mutant, demo_header, tmp_path, python):
    """The control: without validate, these mutants kill the process."""
    path = _mutant(mutant, demo_header, tmp_path)
    run = python.run("-c", BYPASS, path, timeout=120)
    assert run.returncode == -getattr(signal, mutant.crash), (run.returncode, run.stderr[-2000:])


# The crashes, and the template that made decide allocate 3 GiB (str.format's width).
DECIDE = CRASHES + [m for m in MUTANTS if m.id in ("template-width", "template-format-spec")]


@pytest.mark.parametrize("mutant", DECIDE, ids=lambda m: m.id)
def test_decide_exits_with_validates_code_instead_of_a_signal(mutant, demo_header, tmp_path, python):
    path = _mutant(mutant, demo_header, tmp_path)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}))
    run = python.run("-m", "clef_gguf.cli", "decide", path, request, timeout=120)
    assert run.returncode == 7, (run.returncode, run.stderr[-2000:])
    assert validate(path).summary in run.stderr and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_the_runtime_renders_the_template_as_data():
    """Request text is never template code, and the file's template renders the reference's prompt."""
    template = PromptTemplate(SYSTEMONE_TEMPLATE)
    hostile = "{{ range(10**9) }}{% for x in y %}{index:>1000000000}"
    questions = [{"id": hostile, "type": "noul", "instructions": hostile, "options": [{"key": "true", "description": None}]}]
    pieces = list(template.pieces(hostile, questions))
    assert [p.text for p in pieces if p.kind == "question"] == [hostile]
    assert sum(hostile in p.text for p in pieces) == 3  # state, id and instructions, verbatim
