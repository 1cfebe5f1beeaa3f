"""Malformed checkpoints and safetensors headers: a clear ReleaseError (exit 3), never a traceback.

The fuzz tests convert a hand-made checkpoint (tests/file_helpers.py's make_checkpoint) whose
adapter_config.json, or whose adapter_model.safetensors header, hypothesis has damaged: the conversion either
completes or raises ReleaseError. safetensors' header reader is the one release loading uses too. The LoRA data
bytes are all below 0x40, so that whatever dtype a damaged header gives them, their values are finite (and a
refusal is about the header, not NaN). CLEF_FUZZ_EXAMPLES sets the number of examples (default 200 each, ~10 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import run_cli  # the CLI in this process
from file_helpers import MODULE, RELEASE, make_checkpoint
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from safetensors.numpy import load_file

import clef_gguf
from clef_gguf.conversion.release import read_safetensors_index
from clef_gguf.errors import ReleaseError

EXAMPLES = int(os.environ.get("CLEF_FUZZ_EXAMPLES", "200"))
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "clef-gguf-hypothesis"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
A, B = f"base_model.model.{MODULE}.lora_A.weight", f"base_model.model.{MODULE}.lora_B.weight"
VALID_HEADER: dict[str, Any] = {
    "__metadata__": {"format": "pt"},
    A: {"dtype": "F32", "shape": [4, 128], "data_offsets": [0, 2048]},
    B: {"dtype": "F32", "shape": [64, 4], "data_offsets": [2048, 3072]},
}
# Every byte below 0x40: as F32, F16, BF16 or F64 (little-endian) each value is finite and below 2 in magnitude.
DATA = np.random.default_rng(0).integers(0, 0x40, 3072, dtype=np.uint8).tobytes()


def _convert(checkpoint: Path, base: Path, out: Path) -> None:
    clef_gguf.convert(checkpoint, out, "f32", base=base, mmproj=False)


def _refusal(checkpoint: Path, base: Path, out: Path) -> str:
    with pytest.raises(ReleaseError) as raised:
        _convert(checkpoint, base, out)
    assert "\n" not in str(raised.value) and not out.exists()
    return str(raised.value)


def _with_config(ws, folder: Path, **changes: Any) -> Path:
    checkpoint = make_checkpoint(ws.release(RELEASE), folder)
    path = checkpoint / "adapter" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return checkpoint


def _safetensors(header: Any, data: bytes = DATA, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


# --- The cases that gave tracebacks, each named -----------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("r", 0, "r is 0; it must be a positive integer"),  # was ZeroDivisionError
        ("r", "4", 'r is "4"; it must be a positive integer'),
        ("lora_alpha", "8", 'lora_alpha is "8"; it must be a number > 0'),
        ("rank_pattern", ["down_proj"], 'rank_pattern is ["down_proj"]; it must be an object'),
        ("alpha_pattern", {"down_proj": "16"}, 'alpha_pattern["down_proj"] is "16"'),
        ("target_modules", 7, "target_modules is 7; it must be a regex, a list"),
        ("target_modules", "(", 'target_modules "(" is not a regular expression'),
        ("use_rslora", "yes", 'use_rslora is "yes"; it must be true or false'),
    ],
)
def test_an_adapter_config_of_wrong_types_names_the_key(ws, tmp_path, key, value, said):
    checkpoint = _with_config(ws, tmp_path, **{key: value})
    message = _refusal(checkpoint, ws.release(RELEASE), tmp_path / "out.gguf")
    assert "adapter_config.json: " in message and said in message, message


@pytest.mark.parametrize(
    ("header", "said"),
    [
        ({**VALID_HEADER, A: {"dtype": "F32", "data_offsets": [0, 2048]}}, f"tensor '{A}': its header entry has no 'shape'"),
        ([VALID_HEADER], "its header is a JSON list, not an object"),
        ({**VALID_HEADER, A: {**VALID_HEADER[A], "data_offsets": [-8, 2040]}}, "data_offsets [-8, 2040] lie outside"),
        ({**VALID_HEADER, B: {**VALID_HEADER[B], "data_offsets": [1024, 2048]}}, f"tensors '{A}' and '{B}' overlap"),
        (
            {**VALID_HEADER, A: {**VALID_HEADER[A], "shape": [4, 64]}},
            "shape [4, 64] of F32 needs 1024 bytes, data_offsets give 2048",
        ),
        ({**VALID_HEADER, B: {**VALID_HEADER[B], "data_offsets": [2048, 9000]}}, "outside the file's 3072 bytes of data"),
        ({**VALID_HEADER, B: {**VALID_HEADER[B], "dtype": "Q4"}}, "tensor dtype Q4 is not supported"),
    ],
)
def test_a_malformed_safetensors_header_names_the_file_and_key(ws, tmp_path, header, said):
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path)
    (checkpoint / "adapter" / "adapter_model.safetensors").write_bytes(_safetensors(VALID_HEADER))
    _convert(checkpoint, ws.release(RELEASE), tmp_path / "sound.gguf")  # the seed converts: the damage is refused
    (checkpoint / "adapter" / "adapter_model.safetensors").write_bytes(_safetensors(header))
    message = _refusal(checkpoint, ws.release(RELEASE), tmp_path / "out.gguf")
    assert "adapter_model.safetensors" in message and said in message, message


def test_a_release_s_malformed_header_is_a_release_error_too(ws, tmp_path):
    """read_safetensors_index is release loading's reader: a damaged joint_head.safetensors of a release."""
    release = Path(shutil.copytree(ws.release(RELEASE), tmp_path / "release"))
    (release / "joint_head.safetensors").write_bytes(_safetensors({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}))
    with pytest.raises(ReleaseError, match=r"joint_head\.safetensors: tensor 'x': data_offsets is \[0\], not \[begin, end\]"):
        clef_gguf.convert(release, tmp_path / "out.gguf", "f32", mmproj=False)


def test_the_cli_exits_3_on_r_0(ws, tmp_path):
    checkpoint = _with_config(ws, tmp_path, r=0)
    out = tmp_path / "out.gguf"
    run = run_cli("convert", checkpoint, "--base", ws.release(RELEASE), "-o", out, "-t", "f32", "--no-mmproj")
    assert run.returncode == 3 and "Traceback" not in run.stderr and "r is 0" in run.stderr, run.stderr
    assert not out.exists()


# --- Messages that said the wrong thing -----------------------------------------------------------------------------------------
def test_a_rank_mismatch_names_the_weight_that_differs(ws, tmp_path):
    """Was "adapter_config.json gives rank 4, its LoRA weights have rank 4"."""
    b = np.random.default_rng(2).normal(0, 0.05, (64, 3)).astype(np.float32)
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path, a=np.zeros((4, 128), dtype=np.float32), b=b)
    message = _refusal(checkpoint, ws.release(RELEASE), tmp_path / "out.gguf")
    assert "gives rank 4, but its lora_A has 4 rows and its lora_B 3 columns" in message, message


def test_a_transposed_head_tensor_is_a_release_error(ws, tmp_path):
    """docs/finetune.md says a head that does not fit the base exits 3; a transposed one exited 4."""
    head = load_file(str(ws.release(RELEASE) / "joint_head.safetensors"))
    name = "evidence_layers.0.feedforward.0.weight"  # (64, 32)
    head[name] = np.ascontiguousarray(head[name].T)
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path, head=head)
    message = _refusal(checkpoint, ws.release(RELEASE), tmp_path / "out.gguf")
    assert f"tensor \"{name}\" is [32, 64] in the checkpoint, [64, 32] in the base's" in message, message
    out = tmp_path / "cli.gguf"
    assert run_cli("convert", checkpoint, "--base", ws.release(RELEASE), "-o", out, "-t", "f32", "--no-mmproj").returncode == 3


def test_an_adapter_folder_that_is_a_symlink_loop_is_named(ws, tmp_path):
    """Was "--base is for a clef-finetune checkpoint ...; this is not one"."""
    checkpoint = make_checkpoint(ws.release(RELEASE), tmp_path)
    shutil.rmtree(checkpoint / "adapter")
    (checkpoint / "adapter").symlink_to("adapter")
    message = _refusal(checkpoint, ws.release(RELEASE), tmp_path / "out.gguf")
    assert "adapter: a symbolic link that leads to no folder (a loop, or its target is gone)" in message, message
    with pytest.raises(ReleaseError, match="is a clef-finetune checkpoint"):  # without --base: what to add
        clef_gguf.convert(checkpoint, tmp_path / "out.gguf", "f32", mmproj=False)
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    with pytest.raises(ReleaseError, match="a symbolic link that leads nowhere"):
        clef_gguf.convert(loop, tmp_path / "out.gguf", "f32", mmproj=False)
    with pytest.raises(ReleaseError, match="loop: a symbolic link that leads to no folder"):  # the checkpoint itself
        clef_gguf.convert(loop, tmp_path / "out.gguf", "f32", base=ws.release(RELEASE), mmproj=False)


# --- Fuzzing -------------------------------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
PATTERNS = st.sampled_from(["down_proj", "mlp.down_proj", ".*", "(", "[", "a)(b", "(?i)x", "all-linear", "up_proj", "*"])
PATTERNS |= st.text(max_size=5)
RANKS = st.sampled_from([0, 1, 3, 4, 8, -4, 4.0, True]) | JSON
ALPHAS = st.sampled_from([8, 16.5, 0, -8, 1e39, 3.4e38, 1e30, float("nan"), float("inf")]) | st.floats() | JSON
OVERRIDES = st.fixed_dictionaries(
    {},
    optional={
        "peft_type": st.sampled_from(["LORA", "LOHA"]) | JSON,
        "r": RANKS,
        "lora_alpha": ALPHAS,
        "rank_pattern": st.dictionaries(PATTERNS, RANKS, max_size=2) | JSON,
        "alpha_pattern": st.dictionaries(PATTERNS, ALPHAS, max_size=2) | JSON,
        "target_modules": PATTERNS | st.lists(PATTERNS, max_size=3) | JSON,
        "use_rslora": st.booleans() | JSON,
    },
)
DROPS = st.sets(st.sampled_from(["peft_type", "r", "lora_alpha", "target_modules"]), max_size=2)


@pytest.mark.slow
@FUZZ
@given(overrides=OVERRIDES, drops=DROPS, whole=st.none() | JSON)
@example(overrides={"r": 0}, drops=set(), whole=None)  # the F7 cases: tracebacks before
@example(overrides={"r": "4"}, drops=set(), whole=None)
@example(overrides={"lora_alpha": "8"}, drops=set(), whole=None)
@example(overrides={"rank_pattern": ["down_proj"]}, drops=set(), whole=None)
@example(overrides={"target_modules": 7}, drops=set(), whole=None)
def test_fuzz_adapter_config(ws, overrides, drops, whole):
    """make_checkpoint's sound config with keys replaced or dropped (or another JSON value in its place)."""
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_checkpoint(ws.release(RELEASE), Path(folder))
        path = checkpoint / "adapter" / "adapter_config.json"
        config = {k: v for k, v in {**json.loads(path.read_text()), **overrides}.items() if k not in drops}
        path.write_text(json.dumps(config if whole is None else whole))
        try:
            _convert(checkpoint, ws.release(RELEASE), Path(folder) / "out.gguf")
        except ReleaseError as e:
            assert "\n" not in str(e)


INTS = st.integers(-10, 4000) | st.sampled_from([-(2**63), 2**31, 2**63, 2**64 + 1])
OFFSETS = st.lists(INTS, min_size=2, max_size=2) | st.lists(INTS, max_size=3) | JSON
SHAPES = st.lists(st.integers(-2, 130) | st.sampled_from([2**31, 2**62, 2**64]), max_size=3) | JSON
DTYPES = st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "f32", "", "Q4"]) | JSON
EDIT = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from([A, B]), st.sampled_from(["dtype", "shape", "data_offsets"])),
    st.tuples(st.just("set"), st.sampled_from([A, B]), st.just("dtype"), DTYPES),
    st.tuples(st.just("set"), st.sampled_from([A, B]), st.just("shape"), SHAPES),
    st.tuples(st.just("set"), st.sampled_from([A, B]), st.just("data_offsets"), OFFSETS),
    st.tuples(st.just("entry"), st.sampled_from([A, B, "__metadata__"]), JSON),
    st.tuples(st.just("rename"), st.sampled_from([A, B]), st.text(max_size=8)),
    st.tuples(st.just("header"), JSON),
    st.tuples(st.just("length"), st.integers(0, 4000)),
    st.tuples(st.just("truncate"), st.integers(0, 3072)),
)


def _damaged(edits: list[tuple]) -> bytes:
    header: Any = json.loads(json.dumps(VALID_HEADER))
    data, length = DATA, None
    for edit in edits:
        kind = edit[0]
        if kind == "header":
            header = edit[1]
        elif kind == "length":
            length = edit[1]
        elif kind == "truncate":
            data = data[: edit[1]]
        elif isinstance(header, dict) and kind == "entry":
            header[edit[1]] = edit[2]
        elif isinstance(header, dict) and kind == "rename" and edit[1] in header:
            header[edit[2]] = header.pop(edit[1])
        elif isinstance(header, dict) and isinstance(header.get(edit[1]), dict):
            if kind == "drop":
                header[edit[1]].pop(edit[2], None)
            else:
                header[edit[1]][edit[2]] = edit[3]
    return _safetensors(header, data, length)


@pytest.mark.slow
@FUZZ
@given(edits=st.lists(EDIT, min_size=1, max_size=3))
def test_fuzz_safetensors_header(ws, edits):
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = make_checkpoint(ws.release(RELEASE), Path(folder))
        weights = checkpoint / "adapter" / "adapter_model.safetensors"
        weights.write_bytes(_damaged(edits))
        with contextlib.suppress(ReleaseError):
            read_safetensors_index(weights)  # release loading's reader, alone
        try:
            _convert(checkpoint, ws.release(RELEASE), Path(folder) / "out.gguf")
        except ReleaseError as e:
            assert "\n" not in str(e)
