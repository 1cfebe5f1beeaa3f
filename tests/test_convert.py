"""Conversion: the file layout, the metadata, refusals, and atomic writes."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest

import clef_gguf
from clef_gguf.conversion.convert import NUMPY_FILE_TYPES
from clef_gguf.errors import OutputError, ReleaseError
from clef_gguf.format import contract as C
from clef_gguf.format import hparams
from clef_gguf.format.file_types import FILE_TYPES, LLAMA_FILE_TYPES
from clef_gguf.format.header import GGUFFile
from clef_gguf.format.template import SYSTEMONE_TEMPLATE
from clef_gguf.testing.release_builder import CLEF_FLASH_LAYOUT, build_release

GT = gguf.GGMLQuantizationType


def _split(path) -> tuple[list[str], list[str]]:
    names = [t.name for t in gguf.GGUFReader(path).tensors]
    head = [n for n in names if C.is_head_tensor(n)]
    return [n for n in names if n not in head], head


def test_clef_flash_layout_converts_to_427_backbone_and_206_head_tensors(tmp_path):
    """llama.cpp's layout: the 160 tensors of joint_head.safetensors become 206 (q/k/v split, one decision.scales)."""
    release = build_release(tmp_path / "flash", CLEF_FLASH_LAYOUT)
    out = clef_gguf.convert(release, tmp_path / "flash.gguf", "f16")
    backbone, head = _split(out)
    assert (len(backbone), len(head)) == (427, 206)
    assert len(head) == C.head_tensor_count(routing_layers=6, layers=3)
    assert C.reference_tensor_count(routing_layers=6, layers=3) == 160
    reader = gguf.GGUFReader(out)
    recurrent = [bool(v) for v in reader.fields["clef.attention.recurrent_layers"].contents()]
    assert recurrent == [(i + 1) % 4 != 0 for i in range(32)]


def test_metadata_holds_the_decision_contract(ws):
    f = GGUFFile.open(ws.gguf("untied_f32", "q8_0"))
    h = f.header
    assert h.get("general.architecture") == "clef"
    assert h.get(C.KEY_DECISION_TYPE) == "clef"
    assert (h.get(C.KEY_ROUTING_BLOCKS), h.get(C.KEY_JOINT_BLOCKS), h.get(C.KEY_HEAD_COUNT)) == (1, 1, 2)
    assert h.fields[C.KEY_HEAD_NORM_EPS].type == gguf.GGUFValueType.FLOAT32
    assert h.get(C.KEY_REFERENCE_SHA256) == C.REFERENCE_SHA256
    assert h.get(C.KEY_NORMALIZER) == "NFC"
    assert all(f"{C.ARCH}.{s}" in h.fields for s in C.BACKBONE_KEY_SUFFIXES)
    assert h.get(C.KEY_TEMPLATE) == SYSTEMONE_TEMPLATE and h.get(C.KEY_TEMPLATE_NAMES) == ["systemone"]
    assert h.get("tokenizer.ggml.pre") == "qwen35" and h.get("tokenizer.ggml.model") == "gpt2"
    assert h.get("tokenizer.ggml.merges")
    types = {t.type for n, t in h.tensors.items() if not C.is_head_tensor(n)}
    assert GT.Q8_0 in types and GT.F32 in types
    # As llama.cpp's converter: the head's 2-D weights in the file type, biases, norms and token_types in F32.
    head = {n: t.type for n, t in h.tensors.items() if C.is_head_tensor(n)}
    assert head["decision.proj_memory.weight"] == GT.Q8_0 and head["dec.blk.0.cross_attn_q.weight"] == GT.Q8_0
    assert head["token_types.weight"] == head["decision.scales"] == head["dec.blk.0.ffn_up.bias"] == GT.F32
    f.close()


def test_tied_release_has_no_output_tensor(ws):
    h = GGUFFile.open(ws.gguf("tied_bf16", "f32")).header
    assert "output.weight" not in h.tensors and "token_embd.weight" in h.tensors


def test_head_tensors_round_trip_to_the_release(ws, tmp_path):
    """Every value of joint_head.safetensors is in the file: in_proj rows as q, k, v; the scalars as decision.scales."""
    from safetensors.numpy import load_file

    release = ws.release("untied_f32")
    stored = load_file(release / "joint_head.safetensors")
    f = GGUFFile.open(ws.gguf("untied_f32", "f32"))
    config = hparams.head_config(f.header)
    parts: dict[str, list[np.ndarray]] = {}
    for rule in C.head_rules(config):
        parts.setdefault(rule.reference, []).append(np.array(f.tensor_bytes(rule.gguf).view(np.float32)))  # copies
    assert set(parts) | set(C.SCALE_PARAMETERS) == set(stored)
    for name, chunks in parts.items():
        np.testing.assert_array_equal(np.concatenate(chunks), stored[name].reshape(-1))
    scales = np.array(f.tensor_bytes(C.SCALES).view(np.float32))
    expected = C.inference_scales(*(float(stored[n]) for n in C.SCALE_PARAMETERS))
    np.testing.assert_array_equal(scales, np.array(expected, dtype=np.float32))
    f.close()


def _copy(release, tmp_path):
    return shutil.copytree(release, tmp_path / "copy")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: (d / "joint_head.safetensors").unlink(), "joint_head.safetensors is missing"),
        (lambda d: (d / "config.json").unlink(), "config.json is missing"),
        (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]})), "LlamaForCausalLM"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    ],
)
def test_convert_refuses_a_folder_that_is_not_a_clef_release(refused_release, damage, reason):
    assert reason in refused_release(damage)


def test_an_unreachable_hub_repo_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ReleaseError) as raised:
        clef_gguf.convert("nobody/no-such-clef", tmp_path / "out.gguf")
    assert "nobody/no-such-clef" in str(raised.value) and "\n" not in str(raised.value)


def test_existing_output_is_kept_unless_forced(ws, tmp_path):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"precious")
    with pytest.raises(OutputError, match="exists; pass --force"):
        clef_gguf.convert(ws.release("untied_f32"), out, "f32")
    assert out.read_bytes() == b"precious"
    clef_gguf.convert(ws.release("untied_f32"), out, "f32", force=True)
    assert out.read_bytes()[:4] == b"GGUF"


def test_a_failed_conversion_leaves_no_file(ws, tmp_path):
    release = _copy(ws.release("untied_f32"), tmp_path)
    weights = release / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated weights
    out = tmp_path / "out.gguf"
    with pytest.raises(ReleaseError, match="truncated"):
        clef_gguf.convert(release, out, "f32")
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


def test_the_settings_name_exactly_the_types_convert_writes():
    """--type's choices live in settings.py (--help loads no converter): they are llama.cpp's and the writer's own."""
    assert (*LLAMA_FILE_TYPES, *NUMPY_FILE_TYPES) == FILE_TYPES
