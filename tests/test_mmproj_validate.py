"""`clef-gguf validate` on a vision tower (mmproj), alone and with its model: mutants of a converted mmproj,
each with what the vendored clip.cpp would do with it, named in one line with validate's exit codes."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from cli_helpers import run_cli as cli  # the CLI in this process
from fuzz_helpers import MemoryReader, anchors, apply_edits, edits_of
from gguf import GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import clef_gguf
from clef_gguf.check.mmproj import describe_mmproj
from clef_gguf.check.pair import validate_pair
from clef_gguf.check.report import Verdict
from clef_gguf.check.validate import validate, validate_remote
from clef_gguf.conversion.mmproj import MMPROJ_TYPES
from clef_gguf.errors import ModelFileError, NotADecisionModelError
from clef_gguf.format import vision as V
from clef_gguf.format.header import GGUFFile
from clef_gguf.testing.gguf_bytes import f32_tensor, kv_array, kv_i32, kv_str, kv_u32, pack_str, poke, rebuild


def kv_bool(key: str, value: bool) -> bytes:
    return pack_str(key) + struct.pack("<I?", GGUFValueType.BOOL, value)


@pytest.mark.parametrize("file_type", list(MMPROJ_TYPES))
def test_each_type_is_a_complete_mmproj(ws, file_type):
    report = validate(ws.mmproj("untied_f32", file_type))
    assert report.verdict is Verdict.COMPLETE and report.exit_code == 0, report.summary
    assert report.summary.startswith("complete mmproj (qwen3vl_merger): 34 tensors")
    assert "image embeddings 64 wide" in report.summary and report.architecture == "clip"
    assert report.notes == () and report.counts.tensors == 34
    json.dumps(report.to_dict())


def test_the_description_is_what_the_runtime_needs(ws):
    f = GGUFFile.open(ws.mmproj("untied_f32", "f32"))
    d = describe_mmproj(f.header)
    f.close()
    assert d is not None and d.projector == V.PROJECTOR and d.embedding_width == 64
    assert (d.shape.n_layer, d.shape.n_embd, d.shape.patch_size, d.shape.n_positions) == (2, 32, 16, 64)
    assert (d.min_pixels, d.max_pixels) == (16 * 1024, 256 * 1024)


def _kv_floats(key: str, values: list[float]) -> bytes:
    return kv_array(key, GGUFValueType.FLOAT32, "f", values)


def _bf16_patch(ws) -> tuple:
    f = GGUFFile.open(ws.mmproj("untied_f32", "f32"))
    t = f.header.tensors[V.PATCH_EMBD]
    bits = (np.frombuffer(bytes(f.tensor_bytes(V.PATCH_EMBD)), dtype=np.uint32) >> 16).astype(np.uint16)
    f.close()
    return V.PATCH_EMBD, t.dims, int(GGMLQuantizationType.BF16), bits.tobytes()


MUTANTS = {
    "no embedding length": ({"drop_keys": {V.KEY_EMBEDDING_LENGTH}}, "clip.vision.embedding_length is missing"),
    "block count as INT32": ({"replace": {V.KEY_BLOCK_COUNT: kv_i32(V.KEY_BLOCK_COUNT, 2)}}, "reads it as UINT32"),
    "no layer norm epsilon": ({"drop_keys": {V.KEY_LAYER_NORM_EPS}}, "layer_norm_epsilon is missing"),
    "no gelu": ({"drop_keys": {V.KEY_USE_GELU}}, "clip.use_gelu is missing, not true"),
    "gelu and silu": ({"replace": {V.KEY_USE_SILU: kv_bool(V.KEY_USE_SILU, True)}}, "both true"),
    "merge 3": ({"replace": {V.KEY_SPATIAL_MERGE_SIZE: kv_u32(V.KEY_SPATIAL_MERGE_SIZE, 3)}}, "merges 2 x 2 patches"),
    "image size too large": ({"replace": {V.KEY_IMAGE_SIZE: kv_u32(V.KEY_IMAGE_SIZE, 9000)}}, "image_size = 9000 is outside"),
    "two std values": ({"replace": {V.KEY_IMAGE_STD: _kv_floats(V.KEY_IMAGE_STD, [0.5, 0.5])}}, "at least 3 FLOAT32"),
    "zero std": ({"replace": {V.KEY_IMAGE_STD: _kv_floats(V.KEY_IMAGE_STD, [0.5, 0.0, 0.5])}}, "divided by it"),
    "no mean": ({"drop_keys": {V.KEY_IMAGE_MEAN}}, "image_mean must be an array"),
    "heads not dividing": ({"replace": {V.KEY_HEAD_COUNT: kv_u32(V.KEY_HEAD_COUNT, 3)}}, "not a multiple of"),
    "heads too narrow": ({"replace": {V.KEY_HEAD_COUNT: kv_u32(V.KEY_HEAD_COUNT, 16)}}, "2 wide, not a multiple of 4"),
    "projection width": ({"replace": {V.KEY_PROJECTION_DIM: kv_u32(V.KEY_PROJECTION_DIM, 65)}}, "64-wide embeddings"),
    "min pixels only": ({"drop_keys": {V.KEY_IMAGE_MAX_PIXELS}}, "come together"),
    "min above max": (
        {"replace": {V.KEY_IMAGE_MIN_PIXELS: kv_u32(V.KEY_IMAGE_MIN_PIXELS, 1 << 30)}},
        "clip.vision.image_min_pixels 1073741824 exceeds",
    ),
    # llama.cpp overflows an int32 at the image's token count: "image_max_pixels (-2147483648)".
    "max pixels at the int32 bound": (
        {"replace": {V.KEY_IMAGE_MAX_PIXELS: kv_u32(V.KEY_IMAGE_MAX_PIXELS, (1 << 31) - 1)}},
        "in an int32",
    ),
    # Every image's answer NaN: pixels normalized to 1e30 or -1e38.
    "tiny std": ({"replace": {V.KEY_IMAGE_STD: _kv_floats(V.KEY_IMAGE_STD, [0.5, 1e-30, 0.5])}}, "make pixels as large as"),
    "huge mean": ({"replace": {V.KEY_IMAGE_MEAN: _kv_floats(V.KEY_IMAGE_MEAN, [1e38, 0.5, 0.5])}}, "make pixels as large as"),
    "no vision encoder": ({"replace": {V.KEY_HAS_VISION: kv_bool(V.KEY_HAS_VISION, False)}}, "not True"),
    "audio encoder": ({"replace": {V.KEY_HAS_AUDIO: kv_bool(V.KEY_HAS_AUDIO, True)}}, "vision tower only"),
    "projector as UINT32": ({"replace": {V.KEY_PROJECTOR: kv_u32(V.KEY_PROJECTOR, 3)}}, "reads it as STRING"),
    "minicpm version as UINT32": ({"replace": {"clip.minicpmv_version": kv_u32("clip.minicpmv_version", 2)}}, "as INT32"),
    "a missing bias": ({"keep": lambda n: n != "v.blk.1.attn_qkv.bias"}, "1 of the 34 vision tower tensors are missing"),
    "no second frame": ({"keep": lambda n: n != V.PATCH_EMBD_1}, "v.patch_embd.weight.1"),
    "fewer blocks than tensors": (
        {"replace": {V.KEY_BLOCK_COUNT: kv_u32(V.KEY_BLOCK_COUNT, 1)}},
        "1 vision blocks past clip.vision.block_count 1 have tensors (v.blk.1.*)",
    ),
    "more blocks than tensors": ({"replace": {V.KEY_BLOCK_COUNT: kv_u32(V.KEY_BLOCK_COUNT, 3)}}, "12 of the 46"),
    "no positions": ({"keep": lambda n: n != V.POSITION_EMBD}, "v.position_embd.weight or mm.2.bias is missing"),
}


@pytest.mark.parametrize("case", list(MUTANTS))
def test_each_mutant_is_named_with_exit_7(ws, tmp_path, case):
    edit, reason = MUTANTS[case]
    report = validate(rebuild(ws.mmproj("untied_f32", "f32"), tmp_path / "m.gguf", **edit))
    assert report.verdict is Verdict.INCOMPLETE and report.exit_code == 7, report.summary
    assert report.summary.startswith("incomplete or inconsistent mmproj")
    assert any(reason in p.message for p in report.problems), report.problems
    assert "\n" not in report.summary
    json.dumps(report.to_dict())


def test_tensor_mutants_are_named(ws, tmp_path):
    src = ws.mmproj("untied_f32", "f32")
    rng = np.random.default_rng(0)
    cases = {
        "wrong shape": (
            {"keep": lambda n: n != "mm.0.weight", "extra": [f32_tensor("mm.0.weight", (128, 96), rng)]},
            "has shape",
        ),
        "class embedding": ({"extra": [f32_tensor("v.class_embd", (32,), rng)]}, "asserts it is not"),
        "deepstack": ({"extra": [f32_tensor("v.deepstack.0.fc1.weight", (128, 128), rng)]}, "deepstack tensors"),
        "not a square grid": (
            {"keep": lambda n: n != V.POSITION_EMBD, "extra": [f32_tensor(V.POSITION_EMBD, (60, 32), rng)]},
            "not a square grid",
        ),
        "bf16 patch kernel": ({"keep": lambda n: n != V.PATCH_EMBD, "extra": [_bf16_patch(ws)]}, "v.patch_embd.weight (BF16"),
    }
    for case, (edit, reason) in cases.items():
        report = validate(rebuild(src, tmp_path / "t.gguf", **edit))
        assert report.verdict is Verdict.INCOMPLETE, (case, report.summary)
        assert any(reason in p.message for p in report.problems), (case, report.problems)


def test_an_mmproj_of_another_projector_exits_6(ws, tmp_path):
    other = rebuild(
        ws.mmproj("untied_f32", "f32"), tmp_path / "o.gguf", replace={V.KEY_PROJECTOR: kv_str(V.KEY_PROJECTOR, "qwen2vl_merger")}
    )
    report = validate(other)
    assert report.verdict is Verdict.NOT_A_DECISION_MODEL and report.exit_code == 6
    assert "'qwen2vl_merger'" in report.summary and "clef-gguf convert" in report.summary
    run = cli("validate", str(other))
    assert run.returncode == 6 and "qwen2vl_merger" in run.stdout


def test_damaged_mmproj_files_are_corrupt(ws, tmp_path):
    src = ws.mmproj("untied_f32", "f32")
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    report = validate(cut)
    assert report.verdict is Verdict.CORRUPT and "truncated" in report.summary and report.exit_code == 5
    f = GGUFFile.open(src)
    start = f.header.data_offset + f.header.tensors["mm.0.weight"].offset
    f.close()
    nan = tmp_path / "nan.gguf"
    nan.write_bytes(poke(data, start + 8, struct.pack("<f", float("nan"))))
    assert validate(nan).ok
    report = validate(nan, deep=True)
    assert report.verdict is Verdict.CORRUPT and "mm.0.weight holds NaN" in report.summary


def test_the_runtime_refuses_an_mmproj_as_a_model(ws):
    with pytest.raises(NotADecisionModelError, match="vision tower"):
        clef_gguf.load(ws.mmproj("untied_f32", "f32"))


def test_a_model_and_its_mmproj_pair(ws):
    pair = validate_pair(ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32"))
    assert pair.ok and pair.exit_code == 0 and pair.problems == () and "belong together" in pair.summary
    run = cli("validate", str(ws.gguf("untied_f32", "f32")), "--mmproj", str(ws.mmproj("untied_f32", "q8_0")))
    assert run.returncode == 0, run.stdout
    lines = run.stdout.splitlines()
    assert lines[0].endswith("complete Clef decision model: 56 backbone tensors (F32) + 64 head tensors, 853 tokens")
    assert "complete mmproj" in run.stdout and lines[-1].startswith("pairing: model and mmproj belong together")


def test_an_mmproj_of_another_backbone_is_refused(ws):
    model, mmproj = ws.gguf("k256", "f32"), ws.mmproj("untied_f32", "f32")  # hidden sizes 256 and 64
    pair = validate_pair(model, mmproj)
    assert pair.first.ok and pair.second.ok and pair.exit_code == 7
    assert "64 wide, the model's hidden size is 256" in pair.summary
    run = cli("validate", str(model), "--mmproj", str(mmproj), "--json")
    assert run.returncode == 7
    body = json.loads(run.stdout)
    assert body["exit_code"] == 7 and body["mmproj"]["verdict"] == "complete" and "256" in body["pairing"]["summary"]


def test_the_pair_needs_an_mmproj_and_a_model(ws, tmp_path):
    model, mmproj = ws.gguf("untied_f32", "f32"), ws.mmproj("untied_f32", "f32")
    swapped = validate_pair(mmproj, model)
    assert swapped.exit_code == 6 and "not an mmproj" in swapped.second.summary
    assert swapped.first.verdict is Verdict.NOT_A_DECISION_MODEL and "give the model first" in swapped.first.summary
    run = cli("validate", str(model), "--mmproj", str(model))
    assert run.returncode == 6 and "not an mmproj" in run.stdout
    run = cli("validate", str(model), "--mmproj", str(tmp_path / "missing.gguf"))
    assert run.returncode == 5 and "cannot read" in run.stdout
    run = cli("validate", str(model), "--mmproj", str(mmproj), "--sha256", "0" * 64)
    assert run.returncode == 2 and "one file" in run.stderr


# --- Fuzzing: whatever bytes an mmproj holds, a one-line report, and never a model -------------------------------
FUZZ_EXAMPLES = max(50, int(os.environ.get("CLEF_FUZZ_EXAMPLES", "800")) // 4)


@pytest.fixture(scope="module")
def mmproj_seed(ws) -> tuple[bytes, tuple[int, ...]]:
    data = ws.mmproj("untied_f32", "q8_0").read_bytes()
    return data, anchors(data)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.slow
def test_any_damaged_mmproj_gets_a_one_line_report(mmproj_seed, tmp_path_factory, data):
    seed, anchors = mmproj_seed
    damaged = apply_edits(seed, data.draw(edits_of(seed, anchors)))
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    path.write_bytes(damaged)
    report = validate(path, deep=data.draw(st.booleans()))
    assert report.summary and len(report.summary.splitlines()) == 1
    assert report.exit_code == {"complete": 0, "corrupt": 5, "not_a_decision_model": 6, "incomplete": 7}[report.verdict]
    json.dumps(report.to_dict())
    remote = validate_remote(MemoryReader(damaged, str(path)))
    header_only = validate(path)
    assert (remote.verdict, remote.summary) == (header_only.verdict, header_only.summary)
    with pytest.raises(ModelFileError):  # an mmproj, damaged or not, is never loaded as a model
        clef_gguf.load(path)
